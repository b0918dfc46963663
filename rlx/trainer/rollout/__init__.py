"""Rollout engines: sample n responses per prompt with their log-probs, take weight pushes, and
pass the probe that proves they hold the policy's weights.

Engines sit behind one base class (base.RolloutEngine) and a name -> class table; a module is
imported only when its engine is chosen (vLLM's is heavy and absent on most CPUs). This
module imports neither torch nor vLLM: lint and `rlx plan` ask it which engine a recipe gets.

    base.py       the interface every engine implements
    hf.py         transformers' generate (CPU, or a GPU without vLLM)
    decode.py     the HF engine's decode step from the weights, and its key/value cache
    vllm.py       vLLM (GPU, or CPU with vLLM's CPU build)
    colocated.py  the engine a training worker holds (layout: colocated)
    probe.py      the check after every weight push
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlx.recipe.model import LoraSettings, TrainerSettings

# Engine name -> "module:class", imported when chosen.
ENGINES = {
    "hf": "rlx.trainer.rollout.hf:HFEngine",
    "vllm": "rlx.trainer.rollout.vllm:VLLMEngine",
}
# Engines that sample with kernels of their own, not the learner's transformers forward: their
# log-probs can differ from the learner's even in float32.
OWN_KERNELS = frozenset({"vllm"})


def compute_dtype_name(setting: str, on_gpus: bool) -> str:
    """learn.models.compute_dtype's rule without torch: 'auto' is bfloat16 on GPU and float32
    on CPU."""
    if setting == "auto":
        return "bfloat16" if on_gpus else "float32"
    return setting


def engine_dtype_name(settings: TrainerSettings, on_gpus: bool) -> str:
    """The engines' dtype: rollout.dtype, unset the model's. The trainer loads its engines in
    it and `rlx plan` sizes their weights, KV cache and host copies in it."""
    return compute_dtype_name(settings.rollout.dtype or settings.model.dtype, on_gpus)


def samples_with_own_kernels(kind: str) -> bool:
    """Whether engine `kind` computes its log-probs with kernels other than the learner's
    (read without importing the engine)."""
    return kind in OWN_KERNELS


def choose_engine(engine: str, gpus_per_node: int) -> str:
    """The engine a recipe's `trainer.rollout.engine` runs on machines with gpus_per_node
    GPUs: `auto` is vLLM on GPUs and HF generate on CPU. The trainer, the planner and lint
    all ask this one function, so what is planned and checked is what runs (a GPU job whose
    nodes lack vLLM stops at start-up saying so, it does not fall back)."""
    if engine == "auto":
        return "vllm" if gpus_per_node > 0 else "hf"
    if engine not in ENGINES:
        raise ValueError(f"unknown rollout engine {engine!r}; valid: auto, {', '.join(ENGINES)}")
    return engine


def engine_class(kind: str) -> type:
    """The class of engine `kind` (a name of ENGINES), imported now."""
    if kind not in ENGINES:
        raise ValueError(f"unknown rollout engine {kind!r}; valid: {', '.join(ENGINES)}")
    module, _, name = ENGINES[kind].partition(":")
    return getattr(importlib.import_module(module), name)


def make_engine(
    kind: str,
    model_path: str | Path,
    *,
    dtype: str | None = None,
    device: str | None = None,
    max_batch_size: int | None = None,
    vllm_options: dict[str, Any] | None = None,
    lora: LoraSettings | None = None,
) -> Any:
    """An engine of `kind` ("hf" or "vllm", as choose_engine decided) over the model folder.
    vllm_options: vLLM's engine arguments (rollout.vllm_options.vllm_options, which also
    says how vLLM serves LoRA adapters). lora: the policy trains these adapters and pushes
    carry them alone; the HF engine wraps its model with them."""
    engine = engine_class(kind)
    if kind == "vllm":
        return engine(model_path, dtype=dtype or "auto", **dict(vllm_options or {}))
    return engine(model_path, dtype=dtype, device=device, max_batch_size=max_batch_size, lora=lora)


def engine_for_job(
    kind: str,
    settings: TrainerSettings,
    model_path: str,
    *,
    dtype: str,
    device: str,
    use_gpu: bool,
    tensor_parallel: int = 1,
    join_ray: Callable[[], None] | None = None,
) -> Any:
    """An engine of `kind` for a job (layout: split), built with the arguments its class
    makes from the settings (options_from)."""
    from rlx.trainer.rollout.base import EngineSite

    engine = engine_class(kind)
    site = EngineSite(model_path, use_gpu, device, tensor_parallel, join_ray=join_ray)
    options = engine.options_from(settings, site)
    return engine(model_path, dtype=dtype, **options)
