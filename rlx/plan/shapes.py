"""The shape of a decoder-only transformer, as the memory plan needs it, and where it comes
from: the model's config.json (a local folder, or the Hugging Face cache), a `tiny:` spec,
or a built-in table of common architectures so the plan works offline.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlx.errors import RlxError
from rlx.hub import cache_root, cached_file, is_hub_id
from rlx.recipe.specs import TINY_HEAD_DIM, TINY_VOCAB, tiny_model
from rlx.storage import is_store_url

# tiny:<arch>-h<hidden>-l<layers>, as rlx.trainer.resolve builds them (rlx.trainer.model.tiny).
# Architectures whose q/k/v projections carry a bias.
QKV_BIAS_TYPES = ("qwen2",)
# build_tiny_model's max_position_embeddings (a test holds the two equal).
TINY_MAX_POSITIONS = 2048


class PlanError(RlxError):
    """The plan cannot be made (unknown model or accelerator): one line saying what to do."""


@dataclass(frozen=True)
class ModelShape:
    """What the memory of a dense decoder-only LM depends on."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tie_word_embeddings: bool
    head_dim: int
    qkv_bias: bool = False
    source: str = ""
    max_positions: int | None = None  # max_position_embeddings; None when the config has none
    model_type: str = ""  # the config's model_type (qwen2, llama, ...)

    @classmethod
    def from_config(cls, config: Mapping[str, Any], source: str = "config") -> ModelShape:
        """From a Hugging Face config.json's fields (a multimodal config's text_config)."""
        if isinstance(config.get("text_config"), Mapping):
            config = {**config["text_config"], "model_type": config.get("model_type", "")}
        if any(config.get(key) for key in ("num_experts", "num_local_experts", "n_routed_experts")):
            raise PlanError(
                f"{source}: mixture-of-experts models are not planned; only dense decoder LMs"
            )
        try:
            hidden = int(config["hidden_size"])
            heads = int(config["num_attention_heads"])
            shape = cls(
                hidden=hidden,
                layers=int(config["num_hidden_layers"]),
                heads=heads,
                kv_heads=int(config.get("num_key_value_heads") or heads),
                intermediate=int(config["intermediate_size"]),
                vocab=int(config["vocab_size"]),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                head_dim=int(config.get("head_dim") or hidden // heads),
                qkv_bias=bool(
                    config.get("attention_bias", config.get("model_type") in QKV_BIAS_TYPES)
                ),
                source=source,
                max_positions=(
                    int(config["max_position_embeddings"])
                    if config.get("max_position_embeddings")
                    else None
                ),
                model_type=str(config.get("model_type") or ""),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(
                f"{source}: not a decoder LM config the plan understands (missing or bad "
                f"{exc}); give the model's config.json"
            ) from None
        return shape

    # ------------------------------------------------------------------ parameter counts

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """One decoder layer: q, k, v, o (+ q/k/v bias), gate, up, down, two RMSNorms.
        H*q + 2*H*kv + q*H [+ q + 2*kv] + 3*H*I + 2*H."""
        attention = self.hidden * self.q_dim * 2 + 2 * self.hidden * self.kv_dim
        if self.qkv_bias:
            attention += self.q_dim + 2 * self.kv_dim
        return attention + 3 * self.hidden * self.intermediate + 2 * self.hidden

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def root_params(self) -> int:
        """Outside the decoder layers: embeddings, final norm and an untied LM head."""
        head = 0 if self.tie_word_embeddings else self.embedding_params
        return self.embedding_params + self.hidden + head

    @property
    def params(self) -> int:
        """The causal LM: L * layer + embeddings + final norm (+ LM head when untied)."""
        return self.layers * self.layer_params + self.root_params

    @property
    def critic_params(self) -> int:
        """The critic: the LM's body (no LM head) and a value head of H + 1."""
        head = 0 if self.tie_word_embeddings else self.embedding_params
        return self.params - head + self.hidden + 1

    def describe(self) -> str:
        return (
            f"{self.params / 1e9:.2f}B params (hidden {self.hidden}, {self.layers} layers, "
            f"{self.heads}/{self.kv_heads} heads, vocab {self.vocab})"
        )


# Public config.json numbers: (hidden, layers, heads, kv heads, intermediate, vocab, tied,
# max_position_embeddings); head_dim is hidden / heads unless a family says otherwise.
_QWEN25 = {
    "0.5b": (896, 24, 14, 2, 4864, 151936, True, 32768),
    "1.5b": (1536, 28, 12, 2, 8960, 151936, True, 32768),
    "3b": (2048, 36, 16, 2, 11008, 151936, True, 32768),
    "7b": (3584, 28, 28, 4, 18944, 152064, False, 32768),
    "14b": (5120, 48, 40, 8, 13824, 152064, False, 32768),
    "32b": (5120, 64, 40, 8, 27648, 152064, False, 32768),
    "72b": (8192, 80, 64, 8, 29568, 152064, False, 32768),
}
_LLAMA3 = {
    "llama-3-8b": (4096, 32, 32, 8, 14336, 128256, False, 8192),
    "llama-3.1-8b": (4096, 32, 32, 8, 14336, 128256, False, 131072),
    "llama-3-70b": (8192, 80, 64, 8, 28672, 128256, False, 8192),
    "llama-3.1-70b": (8192, 80, 64, 8, 28672, 128256, False, 131072),
    "llama-3.3-70b": (8192, 80, 64, 8, 28672, 128256, False, 131072),
    "llama-3.2-1b": (2048, 16, 32, 8, 8192, 128256, True, 131072),
    "llama-3.2-3b": (3072, 28, 24, 8, 8192, 128256, True, 131072),
}
# The hub ids of the Llama rows (the 3.3 70B is published as an instruct model only).
_LLAMA3_IDS = {
    "llama-3-8b": "meta-llama/Meta-Llama-3-8B",
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B",
    "llama-3-70b": "meta-llama/Meta-Llama-3-70B",
    "llama-3.1-70b": "meta-llama/Llama-3.1-70B",
    "llama-3.3-70b": "meta-llama/Llama-3.3-70B-Instruct",
    "llama-3.2-1b": "meta-llama/Llama-3.2-1B",
    "llama-3.2-3b": "meta-llama/Llama-3.2-3B",
}

# Qwen3's dense models, from each one's config.json on the Hugging Face hub (Qwen/Qwen3-0.6B
# ... Qwen/Qwen3-32B): head_dim 128 throughout (not hidden / heads), vocab 151936,
# max_position_embeddings 40960, embeddings tied up to 4B. Their per-head q/k RMSNorms
# (2 x 128 weights a layer) are left out of the parameter count.
_QWEN3_HEAD_DIM = 128
_QWEN3 = {
    "0.6b": (1024, 28, 16, 8, 3072, 151936, True, 40960),
    "1.7b": (2048, 28, 16, 8, 6144, 151936, True, 40960),
    "4b": (2560, 36, 32, 8, 9728, 151936, True, 40960),
    "8b": (4096, 36, 32, 8, 12288, 151936, False, 40960),
    "14b": (5120, 40, 40, 8, 17408, 151936, False, 40960),
    "32b": (5120, 64, 64, 8, 25600, 151936, False, 40960),
}


def builtin_configs() -> dict[str, dict[str, Any]]:
    """The built-in table as config.json-like dicts, keyed by a normalised model name."""
    table: dict[str, dict[str, Any]] = {}
    rows = [(f"qwen2.5-{size}", "qwen2", row) for size, row in _QWEN25.items()]
    rows += [(name, "llama", row) for name, row in _LLAMA3.items()]
    rows += [(f"qwen3-{size}", "qwen3", row) for size, row in _QWEN3.items()]
    for name, model_type, (hidden, layers, heads, kv, inter, vocab, tied, positions) in rows:
        table[name] = {
            "model_type": model_type,
            "hidden_size": hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
            "intermediate_size": inter,
            "vocab_size": vocab,
            "tie_word_embeddings": tied,
            "max_position_embeddings": positions,
        }
        if model_type == "qwen3":
            table[name]["head_dim"] = _QWEN3_HEAD_DIM
    return table


def builtin_ids() -> dict[str, str]:
    """A hub id for each row of the built-in table, keyed like builtin_configs."""
    ids = {f"qwen2.5-{size}": f"Qwen/Qwen2.5-{size.upper()}" for size in _QWEN25}
    ids.update(_LLAMA3_IDS)
    ids.update({f"qwen3-{size}": f"Qwen/Qwen3-{size.upper()}" for size in _QWEN3})
    return ids


def nearest_builtin(model: str) -> str | None:
    """The hub id of the table's row whose name is nearly the model's (a typo such as
    Qwen2.5-05B), or None. Never a row of another size, whose plan would be another's:
    Llama-2-7b is no typo of Llama-3-70B."""
    name = normalise_name(model)
    size = _size(name)
    ids = builtin_ids()
    same_size = [key for key in ids if size is None or _size(key) == size]
    close = difflib.get_close_matches(name, same_size, n=1, cutoff=0.85)
    return ids[close[0]] if close else None


def _size(name: str) -> str | None:
    """The parameter count a name ends with, dots dropped ('qwen2.5-0.5b' -> '05b')."""
    match = re.search(r"(\d+(?:\.\d+)?)b$", name)
    return match[1].replace(".", "") + "b" if match else None


def normalise_name(model: str) -> str:
    """'Qwen/Qwen2.5-7B-Instruct' -> 'qwen2.5-7b'; 'meta-llama/Meta-Llama-3.1-8B-Instruct'
    -> 'llama-3.1-8b'."""
    name = model.rstrip("/").rsplit("/", 1)[-1].lower()
    name = re.sub(r"-(instruct|chat|it|base|hf)$", "", name)
    return name.removeprefix("meta-")


def _read_config(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise PlanError(f"{path}: cannot read it as JSON ({exc})") from None
    if not isinstance(data, dict):
        raise PlanError(f"{path}: not a model config (a JSON object)")
    return data


def tiny_shape(spec: str) -> ModelShape | None:
    """The shape of a `tiny:` model as rlx.trainer.model.tiny builds it, or None if not one."""
    model = tiny_model(spec)
    if model is None:
        return None
    return ModelShape(
        hidden=model.hidden,
        layers=model.layers,
        heads=model.heads,
        kv_heads=model.heads,
        intermediate=4 * model.hidden,
        vocab=TINY_VOCAB,
        tie_word_embeddings=True,
        head_dim=TINY_HEAD_DIM,
        qkv_bias=model.arch in QKV_BIAS_TYPES,
        source="tiny spec",
        max_positions=TINY_MAX_POSITIONS,
        model_type=model.arch,
    )


def find_shape(model: str, env: Mapping[str, str] | None = None) -> ModelShape:
    """The model's shape: its config.json (local folder, then the HF cache), a tiny spec,
    then the built-in table. PlanError when none knows it."""
    env = os.environ if env is None else env
    tiny = tiny_shape(model)
    if tiny is not None:
        return tiny
    local = Path(model).expanduser()
    if (local / "config.json").is_file():
        return ModelShape.from_config(_read_config(local / "config.json"), str(local))
    cached = cached_file(model, "config.json", env) if is_hub_id(model) else None
    if cached is not None:
        return ModelShape.from_config(_read_config(cached), str(cached))
    builtin = builtin_configs().get(normalise_name(model))
    if builtin is not None:
        return ModelShape.from_config(builtin, f"built-in table ({normalise_name(model)})")
    if is_store_url(model):
        raise PlanError(
            f"{model}: a model in a store, whose config.json the plan does not read, under a "
            "name not in the built-in table; to check its memory, plan a copy of the recipe "
            "whose model.path is a local copy of that folder"
        )
    near = nearest_builtin(model)
    raise PlanError(
        f"{model}: no config.json found (not a local folder, not in the Hugging Face cache "
        f"under {cache_root(env)}) and not in the built-in table"
        + (f" (did you mean {near!r}?)" if near else "")
        + f"; fetch it once (hf download {shlex.quote(model)} config.json) or point "
        "model.path at a folder"
    )
