"""A Hugging Face model folder from a training checkpoint, in one process, offline.

The checkpoint's sharded policy (DCP) is read without a process group, one output file's
worth of tensors at a time, so the exporter never holds more than one shard of the model;
the config, generation config and tokenizer come from the checkpoint's hf/ folder. The
result is what `AutoModelForCausalLM.from_pretrained` loads and vLLM serves: config.json,
generation_config.json, the tokenizer files, and model.safetensors (or numbered
model-0000i-of-0000n.safetensors with model.safetensors.index.json when it is large).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import secrets
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlx.errors import RlxError
from rlx.storage import is_store_url
from rlx.trainer.checkpoint.parts import fsync_path, read_part
from rlx.trainer.checkpoint.store import MARKER, newest_complete, read_marker, verify_files
from rlx.trainer.checkpoint.training import (
    EXPORT_INFO,
    HF_FILES,
    LEARNER_STATE,
    LORA_PART,
    single_process_quiet,
)

# Output files up to this size (the size Hugging Face's own uploads use).
MAX_SHARD_BYTES = 5 << 30
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class Exported:
    folder: Path  # (a URL when the export went to a store)
    files: int  # safetensors files
    tensors: int
    bytes: int  # the weights' size on disk
    dtype: str


def check_checkpoint(path: Path) -> dict[str, Any]:
    """The marker of an exportable checkpoint; RlxError saying what is wrong otherwise."""
    if not path.exists():
        raise RlxError(f"{path} does not exist; give a checkpoint's step-NNNNNN folder")
    if not path.is_dir():
        raise RlxError(f"{path} is not a folder; give a checkpoint's step-NNNNNN folder")
    marker = read_marker(path)
    if marker is None:
        newest = newest_complete(path)
        if newest is not None:
            hint = f"it looks like a run folder; did you mean {newest}?"
        elif (path / MARKER).exists() or path.name.startswith((".step-", "step-")):
            hint = f"it has no valid {MARKER} marker (an interrupted save)"
        else:
            hint = "it is not a checkpoint (no step-NNNNNN name and COMPLETE marker)"
        raise RlxError(f"{path} is not a complete checkpoint: {hint}")
    missing = [name for name in (LEARNER_STATE, HF_FILES) if name not in marker["parts"]]
    if missing:
        raise RlxError(
            f"{path} has no {' or '.join(missing)} part: it was written by an older rlx "
            "(a single-file checkpoint); resume it with that version, or train anew"
        )
    return marker


def export_checkpoint(
    checkpoint: Path | str,
    out: Path | str,
    *,
    replace: bool = False,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    merge: bool = False,
) -> Exported:
    """Write checkpoint's policy as a Hugging Face folder at out (atomically: it appears
    complete or not at all). A LoRA run's policy is its adapter: written in PEFT's format
    (adapter_config.json, adapter_model.safetensors: what PeftModel.from_pretrained and
    vLLM's --lora-modules load), or with merge, merged into its base (read from where the
    run read it) as a whole model. An existing out is an error unless replace. Either may
    be a store URL: the checkpoint's files are fetched to a scratch folder first (checked
    against their marker), the folder is uploaded after it is written."""
    options = _Options(replace, max_shard_bytes, merge)
    if isinstance(checkpoint, str) and is_store_url(checkpoint):
        return _export_from_store(checkpoint, out, options)
    if isinstance(out, str) and is_store_url(out):
        return _export_to_store(Path(checkpoint), out, options)
    return _export_local(Path(checkpoint), Path(out), options)


@dataclass(frozen=True)
class _Options:
    replace: bool
    max_shard_bytes: int
    merge: bool


def _export_from_store(url: str, out: Path | str, options: _Options) -> Exported:
    from rlx.trainer.checkpoint.remote import fetch_files, read_marker_url, remove, scratch_folder

    marker = read_marker_url(url)
    if marker is None:
        raise RlxError(
            f"{url} is not a complete checkpoint: no valid {MARKER} marker there (an "
            "interrupted save, or not a step-NNNNNN prefix)"
        )
    scratch = scratch_folder("export")
    try:
        local = scratch / url.rstrip("/").rsplit("/", 1)[-1]
        local.mkdir()
        wanted = [name for name in EXPORT_PARTS if name in marker["parts"]]
        fetch_files(url, [marker["parts"][name]["file"] for name in wanted], marker, local)
        kept = {name: marker["parts"][name] for name in wanted}
        files = [
            f
            for f in marker["files"]
            if any(
                f["name"] == e["file"] or f["name"].startswith(e["file"] + "/")
                for e in kept.values()
            )
        ]
        (local / MARKER).write_text(json.dumps({**marker, "parts": kept, "files": files}))
        return export_checkpoint(
            local,
            out,
            replace=options.replace,
            max_shard_bytes=options.max_shard_bytes,
            merge=options.merge,
        )
    finally:
        remove(scratch)


def _export_to_store(checkpoint: Path, url: str, options: _Options) -> Exported:
    from rlx.storage import filesystem
    from rlx.trainer.checkpoint.remote import remove, scratch_folder

    fs, base = filesystem(url)
    if fs.exists(base) and fs.ls(base) and not options.replace:
        raise RlxError(f"{url} already exists; give a new prefix or remove it first")
    scratch = scratch_folder("export")
    try:
        exported = _export_local(
            checkpoint, scratch / "model", dataclasses.replace(options, replace=False)
        )
        if options.replace and fs.exists(base):
            fs.rm(base, recursive=True)
        names = sorted(p.name for p in exported.folder.iterdir())
        fs.put([str(exported.folder / n) for n in names], [f"{base}/{n}" for n in names])
        return dataclasses.replace(exported, folder=url)  # type: ignore[arg-type]
    finally:
        remove(scratch)


# The parts an export reads: the policy's shards, the model's small files, the dtype, LoRA's
# record of the adapter's base and config.
EXPORT_PARTS = (LEARNER_STATE, HF_FILES, EXPORT_INFO, LORA_PART)


def _export_local(checkpoint: Path, out: Path, options: _Options) -> Exported:
    marker = check_checkpoint(checkpoint)
    if out.exists() and not options.replace and (not out.is_dir() or any(out.iterdir())):
        raise RlxError(f"{out} already exists; give a new folder or remove it first")
    verify_files(checkpoint, marker["files"], EXPORT_PARTS)
    info = {}
    if EXPORT_INFO in marker["parts"]:
        info = read_part(checkpoint, marker["parts"][EXPORT_INFO])
    dtype_name = info.get("dtype", "float32")
    adapter = None
    if LORA_PART in marker["parts"]:
        adapter = read_part(checkpoint, marker["parts"][LORA_PART]).get("policy")
    if options.merge and adapter is None:
        raise RlxError(
            f"{checkpoint} holds a whole model, not a LoRA adapter: nothing to merge; "
            "export it without --merge"
        )

    out.parent.mkdir(parents=True, exist_ok=True)
    temporary = out.with_name(f".{out.name}.tmp-{secrets.token_hex(4)}")
    temporary.mkdir()
    try:
        shutil.copytree(checkpoint / HF_FILES, temporary, dirs_exist_ok=True)
        if adapter is None:
            skip = tied_names(temporary)
            exported = write_weights(
                checkpoint / LEARNER_STATE, temporary, dtype_name, skip, options.max_shard_bytes
            )
            write_configs(temporary, dtype_name)
        elif options.merge:
            exported = write_merged(checkpoint / LEARNER_STATE, temporary, adapter, dtype_name)
        else:
            exported = write_adapter(checkpoint / LEARNER_STATE, temporary, adapter)
        for path in temporary.iterdir():
            fsync_path(path)
        fsync_path(temporary)
        if out.exists():
            old = out.with_name(f".{out.name}.old-{secrets.token_hex(4)}")
            out.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        temporary.rename(out)
        fsync_path(out.parent)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    return Exported(out, exported[0], exported[1], exported[2], dtype_name)


def tied_names(folder: Path) -> set[str]:
    """Parameters that are views of others in this architecture (tied output embedding):
    Hugging Face folders leave them out, from_pretrained ties them back."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(folder)
    except (ValueError, OSError, KeyError):
        return set()  # an architecture this transformers does not know: keep every tensor
    if getattr(config, "tie_word_embeddings", False):
        return {"lm_head.weight"}
    return set()


def saved_tensors(dcp_folder: Path, prefix: str) -> dict[str, Any]:
    """{name: storage metadata (size, dtype)} of the whole tensors saved under prefix."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(dcp_folder)).read_metadata()
    return {
        key.removeprefix(f"{prefix}."): item
        for key, item in sorted(metadata.state_dict_metadata.items())
        if key.startswith(f"{prefix}.") and isinstance(item, TensorStorageMetadata)
    }


def read_tensors(dcp_folder: Path, prefix: str, names: Iterable[str]) -> dict[str, Any]:
    """Whole tensors (as saved: shape and dtype) of the named entries under prefix ("policy",
    "critic"), read in this process alone however many ranks wrote them."""
    import torch
    import torch.distributed.checkpoint as dcp

    saved = saved_tensors(dcp_folder, prefix)
    # (shape of the saved tensor) each, in the saved dtype, filled by DCP in place.
    tensors = {
        name: torch.empty(tuple(saved[name].size), dtype=saved[name].properties.dtype)
        for name in names
    }
    with single_process_quiet():
        dcp.load(
            {prefix: tensors}, storage_reader=dcp.FileSystemReader(str(dcp_folder)), no_dist=True
        )
    return tensors


def write_weights(
    dcp_folder: Path, out: Path, dtype_name: str, skip: set[str], max_shard_bytes: int
) -> tuple[int, int, int]:
    """The policy's tensors from a DCP folder into safetensors files of at most
    max_shard_bytes each (a larger single tensor gets a file of its own), read one file's
    worth at a time. Returns (files, tensors, bytes)."""
    import torch
    from safetensors.torch import save_file

    dtype = getattr(torch, dtype_name)
    names = {n: item for n, item in saved_tensors(dcp_folder, "policy").items() if n not in skip}
    if not names:
        raise RlxError(f"{dcp_folder} holds no policy weights")

    element = torch.empty((), dtype=dtype).element_size()
    groups: list[list[str]] = [[]]
    group_bytes = 0
    for name, item in names.items():
        size = item.size.numel() * element
        if groups[-1] and group_bytes + size > max_shard_bytes:
            groups.append([])
            group_bytes = 0
        groups[-1].append(name)
        group_bytes += size

    weight_map: dict[str, str] = {}
    total = 0
    for index, group in enumerate(groups, start=1):
        tensors = read_tensors(dcp_folder, "policy", group)
        tensors = {name: tensor.to(dtype).contiguous() for name, tensor in tensors.items()}
        file = SINGLE_FILE
        if len(groups) > 1:
            file = f"model-{index:05d}-of-{len(groups):05d}.safetensors"
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        (out / file).chmod(0o644)  # a model folder others serve; safetensors writes 0600
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(group, file))
        del tensors
    if len(groups) > 1:
        index_data = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index_data, indent=2, sort_keys=True))
    return len(groups), len(names), total


def write_configs(folder: Path, dtype_name: str) -> None:
    """config.json with the exported dtype; a generation config from the model config when
    the source folder had none."""
    from transformers import AutoConfig, GenerationConfig

    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config["torch_dtype"] = dtype_name
    if "dtype" in config:
        config["dtype"] = dtype_name
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if not (folder / "generation_config.json").is_file():
        with contextlib.suppress(ValueError, OSError):
            generation = GenerationConfig.from_model_config(AutoConfig.from_pretrained(folder))
            generation.save_pretrained(folder)


ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def _adapter_tensors(dcp_folder: Path) -> dict[str, Any]:
    """The policy's adapter tensors, keyed as PEFT saves them."""
    from rlx.trainer.model.lora import is_adapter, peft_key

    names = [n for n in saved_tensors(dcp_folder, "policy") if is_adapter(n)]
    if not names:
        raise RlxError(f"{dcp_folder} holds no LoRA adapter tensors")
    tensors = read_tensors(dcp_folder, "policy", names)
    return {peft_key(name): tensor.contiguous() for name, tensor in tensors.items()}


def write_adapter(dcp_folder: Path, out: Path, adapter: dict[str, Any]) -> tuple[int, int, int]:
    """The adapter in PEFT's format beside the base's config and tokenizer (already in out):
    adapter_model.safetensors (float32, as trained) and adapter_config.json naming the base
    as the run named it. Returns (files, tensors, bytes)."""
    from safetensors.torch import save_file

    tensors = _adapter_tensors(dcp_folder)
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (out / ADAPTER_WEIGHTS).chmod(0o644)
    config = {**adapter["peft_config"], "base_model_name_or_path": adapter["base"]}
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return 1, len(tensors), sum(t.numel() * t.element_size() for t in tensors.values())


def write_merged(
    dcp_folder: Path, out: Path, adapter: dict[str, Any], dtype_name: str
) -> tuple[int, int, int]:
    """The adapter merged into its base (read where the run read it: a hub id from this
    machine's hub cache, else the folder the run read, else the base as a folder), saved
    whole in the run's dtype."""
    import torch
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from rlx.hub import is_hub_id, snapshot
    from rlx.trainer.model.lora import base_fingerprint

    base = adapter["base"]
    if is_hub_id(base):
        folder = str(snapshot(base, field="the adapter's base"))
    else:
        read = adapter.get("folder")
        folder = read if read and Path(read).is_dir() else base
    if not Path(folder).is_dir() or base_fingerprint(folder) != adapter["fingerprint"]:
        raise RlxError(
            f"the adapter's base {base} is not the model it was trained on here ({folder}); "
            "merge where the run's base is, or export the adapter alone"
        )
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    recorded = adapter["peft_config"]
    fields = [f.name for f in dataclasses.fields(LoraConfig) if f.init and f.name in recorded]
    peft_model = get_peft_model(model, LoraConfig(**{name: recorded[name] for name in fields}))
    tensors = _adapter_tensors(dcp_folder)
    result = set_peft_model_state_dict(peft_model, tensors)
    if getattr(result, "unexpected_keys", None):
        raise RlxError(f"the adapter does not fit its base: {result.unexpected_keys[:3]}")
    merged = peft_model.merge_and_unload()
    merged.to(getattr(torch, dtype_name)).save_pretrained(out, safe_serialization=True)
    weights = sorted(out.glob("*.safetensors"))
    tensor_count = sum(1 for _ in merged.state_dict())
    return len(weights), tensor_count, sum(p.stat().st_size for p in weights)
