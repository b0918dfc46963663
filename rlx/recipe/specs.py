"""The names a recipe may give things rlx makes itself, and what a local path looks like.

- `tiny:<arch>-h<hidden>-l<layers>[-e<std>]`: a small random model built locally (nothing is
  downloaded), e.g. tiny:qwen2-h64-l2. Its heads have TINY_HEAD_DIM dimensions, the size
  vLLM's CPU attention supports, so a tiny model runs on either engine. `-e<std>` draws its
  token embeddings (and so its tied LM head) with that standard deviation instead of
  transformers' 0.02: at 0.02 a frozen random head can hardly move the output, so LoRA
  adapters on a tiny base learn only with a stronger one (tiny:qwen2-h64-l2-e0.1).
- `synthetic:<task>`: a prompt file generated locally, e.g. synthetic:letters_or_digits.
- `hf://<org>/<name>[@<revision>]`: a dataset repository on the Hugging Face hub (a branch,
  tag or commit after @; the main branch without one), e.g. hf://openai/gsm8k.

One grammar for lint, the planner and the trainer: each asks the functions here, and each
problem is worded once. Light: no torch, no transformers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TINY_PREFIX = "tiny:"
TINY_SPEC = re.compile(
    r"tiny:(?P<arch>[a-z0-9]+)-h(?P<hidden>[0-9]+)-l(?P<layers>[0-9]+)"
    r"(?:-e(?P<embed>[0-9]*\.?[0-9]+))?"
)
TINY_ARCHS = ("qwen2", "llama")
TINY_HEAD_DIM = 64
# The byte-level tokenizer: token ids 0..255 are the bytes, the special tokens follow.
TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")
TINY_VOCAB = 256 + len(TINY_SPECIAL_TOKENS)

SYNTHETIC_PREFIX = "synthetic:"
HUB_DATA_PREFIX = "hf://"
HUB_DATA_SPEC = re.compile(
    r"hf://(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[^\s@]+))?"
)
# Synthetic task -> the function that writes its rows ("module:function", imported when used).
SYNTHETIC_TASKS = {
    "letters_or_digits": "rlx.trainer.tasks.synthetic:write_synthetic_dataset",
    "arithmetic": "rlx.trainer.tasks.synthetic:write_arithmetic_dataset",
    "tool_lookup": "rlx.trainer.tasks.tools:write_tool_lookup_dataset",
}


@dataclass(frozen=True)
class TinyModel:
    """What a tiny spec builds."""

    arch: str
    hidden: int
    layers: int
    embed_std: float | None = None  # the token embeddings' std (None: transformers' own)

    @property
    def name(self) -> str:
        """The spec's part after tiny:, e.g. qwen2-h64-l2 or qwen2-h64-l2-e0.1."""
        base = f"{self.arch}-h{self.hidden}-l{self.layers}"
        return base if self.embed_std is None else f"{base}-e{self.embed_std:g}"

    @property
    def heads(self) -> int:
        return self.hidden // TINY_HEAD_DIM


def tiny_spec_problem(spec: str) -> str | None:
    """What is wrong with a `tiny:` spec, worded to follow it (None when it is fine)."""
    match = TINY_SPEC.fullmatch(spec)
    if match is None:
        return (
            "is not a tiny model spec; write tiny:<arch>-h<hidden>-l<layers>[-e<std>], e.g. "
            "tiny:qwen2-h64-l2"
        )
    hidden = int(match["hidden"])
    if match["arch"] not in TINY_ARCHS:
        return f"names tiny arch {match['arch']!r}, which is not one of {', '.join(TINY_ARCHS)}"
    if hidden < TINY_HEAD_DIM or hidden % TINY_HEAD_DIM:
        return (
            f"has hidden size {hidden}; tiny models need a multiple of {TINY_HEAD_DIM} (their "
            f"heads have {TINY_HEAD_DIM} dimensions)"
        )
    if int(match["layers"]) < 1:
        return "has no layers; tiny models need at least one"
    if match["embed"] is not None and not 0 < float(match["embed"]) <= 1:
        return f"asks for embeddings of std {match['embed']}; write -e with a value in (0, 1]"
    return None


def tiny_model(spec: str) -> TinyModel | None:
    """The model a valid `tiny:` spec builds; None for any other model path (a folder, a hub
    id) and for an invalid spec (tiny_spec_problem says what is wrong)."""
    match = TINY_SPEC.fullmatch(spec)
    if match is None or tiny_spec_problem(spec) is not None:
        return None
    embed = None if match["embed"] is None else float(match["embed"])
    return TinyModel(match["arch"], int(match["hidden"]), int(match["layers"]), embed)


def synthetic_task_problem(spec: str) -> str | None:
    """What is wrong with a `synthetic:` data spec (None when it names a task)."""
    if spec.removeprefix(SYNTHETIC_PREFIX) in SYNTHETIC_TASKS:
        return None
    valid = ", ".join(f"{SYNTHETIC_PREFIX}{task}" for task in SYNTHETIC_TASKS)
    return f"unknown synthetic task {spec!r}; valid: {valid}"


def is_local_path(path: str) -> bool:
    """A path the recipe means as a file or folder on the machine (absolute, relative with
    ./ or ../, or under ~), not a hub id or another scheme's name."""
    return path.startswith(("/", "./", "../", "~")) or path in (".", "..")


@dataclass(frozen=True)
class HubData:
    """What an `hf://` data spec names: a dataset repository and the revision asked for."""

    repo_id: str
    revision: str | None  # None: the main branch, as the hub has it when the run starts


def hub_data(spec: str) -> HubData | None:
    """The dataset repository an `hf://org/name[@revision]` spec names; None for anything
    else, an `hf://` spec that is malformed included (hub_data_problem says what is wrong)."""
    match = HUB_DATA_SPEC.fullmatch(spec)
    if match is None:
        return None
    return HubData(match["repo"], match["revision"])


def hub_data_problem(spec: str) -> str | None:
    """What is wrong with an `hf://` data spec, worded to follow it (None when it is fine)."""
    if hub_data(spec) is not None:
        return None
    return (
        "is not a hub dataset id; write hf://org/name or hf://org/name@revision (a branch, "
        "tag or commit), e.g. hf://openai/gsm8k"
    )
