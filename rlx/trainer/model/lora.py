"""LoRA through peft: the adapters a policy (or critic body) trains instead of its weights.

peft wraps the model (`get_peft_model`): every targeted linear layer keeps its frozen weight
as `...<layer>.base_layer.weight` and gains `...<layer>.lora_A.default.weight` (r x in) and
`lora_B.default.weight` (out x r), whose product, scaled by alpha / r, is added to its output.
Only the adapters train; `disable_adapter()` switches them off, which is how the policy is
also its own reference (the base). The adapters start as peft starts them (A uniform in
+-1/sqrt(in), B zero, so the first policy is the base), but drawn from the run's seed and
the parameter's name, so every rank and every strategy (FSDP shards included, which draw
their rows of the same tensor) starts from the same adapter.

Names: a parameter of the wrapped model maps to the base checkpoint's name by dropping
peft's prefix and `.base_layer` (`base_name`), and an adapter to PEFT's saved format by
dropping the adapter's name (`peft_key`), the keys of adapter_model.safetensors that peft and
vLLM load.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from rlx.trainer.model.dtensors import local_rows

if TYPE_CHECKING:
    from rlx.recipe.model import LoraSettings

PEFT_PREFIX = "base_model.model."
ADAPTER = "default"  # peft's name of the one adapter rlx trains
LORA_MARKERS = (".lora_A.", ".lora_B.")
SAMPLE_BYTES = 4096  # read from the start of each tensor of a base, for base_fingerprint


def lora_config(settings: LoraSettings, task: str = "CAUSAL_LM") -> Any:
    from peft import LoraConfig

    targets = settings.target_modules
    return LoraConfig(
        r=settings.rank,
        lora_alpha=settings.scale_alpha,
        lora_dropout=settings.dropout,
        target_modules=targets if isinstance(targets, str) else list(targets),
        task_type=task,
        bias="none",
    )


def served_config(settings: LoraSettings) -> dict[str, Any]:
    """What an engine serving these adapters needs of their config (vLLM's PEFTHelper):
    rank, alpha (the scale is alpha / rank), the targets."""
    targets = settings.target_modules
    return {
        "r": settings.rank,
        "lora_alpha": settings.scale_alpha,
        "target_modules": targets if isinstance(targets, str) else list(targets),
        "bias": "none",
    }


def add_adapters(model: nn.Module, settings: LoraSettings, task: str = "CAUSAL_LM") -> nn.Module:
    """The model wrapped by peft with fresh adapters (their values: init_adapters)."""
    from peft import get_peft_model

    try:
        return get_peft_model(model, lora_config(settings, task))
    except ValueError as exc:  # peft names targets the model lacks
        from rlx.errors import RlxError

        first = str(exc).strip().splitlines()[0]
        raise RlxError(f"trainer.model.lora.target_modules: {first}") from None


def is_adapter(name: str) -> bool:
    return any(marker in name for marker in LORA_MARKERS)


def base_name(name: str) -> str:
    """A wrapped model's parameter name as the base model names it."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def peft_key(name: str) -> str:
    """An adapter parameter's key in PEFT's saved format (adapter_model.safetensors)."""
    name = name if name.startswith(PEFT_PREFIX) else PEFT_PREFIX + name
    return name.replace(f".{ADAPTER}.", ".")


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    """Every adapter set as peft starts it, from the seed and its name: A uniform in
    +-1/sqrt(fan_in) (peft's kaiming_uniform with a = sqrt(5)), B zero. A sharded adapter
    takes its rows of the same whole tensor."""
    for name, param in model.named_parameters():
        if not is_adapter(name):
            continue
        local, first = local_rows(param)
        if ".lora_B." in name:
            local.zero_()
            continue
        rows, fan_in = param.shape[0], math.prod(param.shape[1:])
        generator = torch.Generator().manual_seed(_stream(seed, base_name(name)))
        bound = 1.0 / math.sqrt(fan_in)
        whole = torch.empty((rows, fan_in), dtype=torch.float32).uniform_(
            -bound, bound, generator=generator
        )
        local.copy_(whole[first : first + local.shape[0]].view_as(local))


def _stream(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def adapter_parameters(model: nn.Module) -> list[tuple[str, Tensor]]:
    return [(name, param) for name, param in model.named_parameters() if is_adapter(name)]


def adapter_bytes(model: nn.Module) -> int:
    """Bytes of every adapter tensor, whole (what a push of the adapter carries)."""
    return sum(param.numel() * param.element_size() for _, param in adapter_parameters(model))


def base_fingerprint(folder: str) -> str:
    """What names a base model's weights, cheaply: its config and, per weight file, its name,
    its size and its content: a hub cache's blob name where the file is one (the content's
    hash), else its header and the first bytes of every tensor. Two bases of
    the same shapes and other weights (a fine-tuned variant) differ."""
    from pathlib import Path

    root = Path(folder)
    digest = hashlib.sha256()
    config = root / "config.json"
    digest.update(config.read_bytes() if config.is_file() else b"")
    for weights in sorted(root.glob("*.safetensors")):
        size = weights.stat().st_size
        digest.update(f"{weights.name}:{size}\n".encode())
        target = weights.resolve()
        if target.parent.name == "blobs":  # the hub cache's layout: named by its hash
            digest.update(target.name.encode())
            continue
        with weights.open("rb") as handle:
            header = handle.read(8)
            length = int.from_bytes(header, "little") if len(header) == 8 else 0
            table = handle.read(min(length, size))
            digest.update(header + table)
            try:
                entries = json.loads(table)
            except ValueError:
                entries = {}
            starts = sorted(
                int(entry["data_offsets"][0])
                for name, entry in entries.items()
                if name != "__metadata__" and isinstance(entry, dict) and "data_offsets" in entry
            )
            for at in starts:  # the first bytes of every tensor
                handle.seek(8 + length + at)
                digest.update(handle.read(SAMPLE_BYTES))
    return digest.hexdigest()[:16]


def adapter_record(model: nn.Module, base: str, folder: str) -> dict[str, Any]:
    """What a checkpoint keeps of a model's adapters besides their tensors: the base they
    were trained on (as the recipe names it, and its fingerprint) and peft's config of them
    (what adapter_config.json holds)."""
    config = model.peft_config[ADAPTER].to_dict()  # type: ignore[union-attr, index]
    return {
        "base": base,
        "folder": folder,  # where this run read it (a tiny: base or a store's copy)
        "fingerprint": base_fingerprint(folder),
        "peft_config": json.loads(json.dumps(config, default=lambda v: sorted(v))),
    }


def check_base(record: dict[str, Any], base: str, folder: str, what: str) -> None:
    """A checkpoint's adapters go on the base they were trained on: another base is one
    line, not a silent mix."""
    from rlx.errors import RlxError

    if record["fingerprint"] != base_fingerprint(folder):
        raise RlxError(
            f"the checkpoint's {what} adapters were trained on {record['base']} (fingerprint "
            f"{record['fingerprint']}), and this run's base {base} is another model "
            f"({base_fingerprint(folder)}); resume with the same base, or set RLX_RUN_ID to "
            "start a new run"
        )
