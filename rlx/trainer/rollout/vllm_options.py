"""vLLM's arguments for an engine of a job, decided beside the engine from the trainer settings:
the context length, the KV cache on CPU, the executor (in this process, processes, or vLLM's
Ray executor) and the cores of a tensor-parallel engine on CPU. Imports neither torch nor
vLLM: vLLM is imported only where its engine is built (vllm.py).
"""

from __future__ import annotations

import os
from typing import Any

from rlx.recipe.model import TrainerSettings


def vllm_options(
    settings: TrainerSettings,
    tensor_parallel: int,
    model_path: str,
    *,
    use_gpu: bool,
    in_process: bool = False,
) -> dict[str, Any]:
    """vLLM's arguments for an engine of this job, with this process's environment made
    ready for it (a variable already set is kept).

    in_process (a colocated engine): vLLM runs in this very process, so the policy's tensors
    are handed over without a copy through host memory (GPU tensors stay on the GPU). One
    engine on CPU runs in-process too. A tensor-parallel engine runs on GPUs under vLLM's
    Ray executor (the actor holding it lets that executor find Ray and the GPUs), on CPU with
    its engine core in this process and its workers in processes, each bound to its share of
    this process's cores."""
    rollout = settings.rollout
    options: dict[str, Any] = {
        "tensor_parallel_size": tensor_parallel,
        "max_model_len": max_model_len(settings),
        "seed": settings.seed,
        "trust_remote_code": settings.model.trust_remote_code,
    }
    if in_process or (tensor_parallel == 1 and not use_gpu):
        # One engine runs best in this process on CPU too: vLLM's default puts its engine
        # core (a busy loop) and its model worker in two more processes that then compete
        # for the same cores. In-process, an engine pinned to one core generated the
        # quickstart's step in 0.24 s instead of 0.37 s, and started in 9 s, not 26 s.
        options["distributed_executor_backend"] = "uni"
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    elif tensor_parallel > 1:
        # Chosen, not left to vLLM: on GPUs its Ray executor, one worker per GPU bundle of
        # the engine's placement group (exactly the GPUs rlx reserved); on CPU processes.
        options["distributed_executor_backend"] = "ray" if use_gpu else "mp"
        if not use_gpu:
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_binding(tensor_parallel))
            # The engine core in this process and only the workers in processes of their
            # own: a process of its own for the core would import torch and vLLM once more
            # (about 15 CPU-s) to run a loop that waits on the workers.
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    lora = settings.model.lora
    if lora is not None:
        # Pushes carry adapters: vLLM serves each version as one, the policy's and the
        # max_staleness older ones, at the smallest rank slot that holds the rank (its
        # memory, and on CPU its ops' scratch, grow with the slot). adapter_config is
        # VLLMEngine's own: the served adapters' config.
        from rlx.plan.lora import vllm_lora_rank, vllm_max_loras
        from rlx.trainer.model.lora import served_config

        slot = vllm_lora_rank(lora.rank)
        if slot is None:
            raise ValueError(f"LoRA rank {lora.rank} is more than vLLM serves")
        versions = vllm_max_loras(rollout)
        options.update(
            enable_lora=True,
            max_lora_rank=slot,
            max_loras=versions,
            max_cpu_loras=versions,
            adapter_config=served_config(lora),
        )
    if use_gpu:
        options["gpu_memory_utilization"] = rollout.gpu_memory_utilization
    else:
        # vLLM's CPU build reads gpu_memory_utilization as a share of host RAM; a step's
        # sequences need far less, sized from the model instead. No graph capture on CPU.
        options["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(settings, model_path)
        options["enforce_eager"] = True
    return options


def max_model_len(settings: TrainerSettings) -> int:
    """The longest sequence an engine is asked for: a prompt and the longest response
    (rollout or validation) or the longest episode (prompt, every turn and every
    observation), plus the one token the probe's request generates."""
    from rlx.recipe.model import episode_token_budget

    longest = episode_token_budget(settings)
    validation = settings.validation
    if validation is not None and validation.max_new_tokens is not None:
        longest = max(longest, validation.max_new_tokens)
    return settings.data.max_prompt_length + longest + 1


def cpu_binding(tensor_parallel: int, cores: list[int] | None = None) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `tensor_parallel` workers over these cores (this
    process's by default): consecutive, equal shares, "0-3|4-7"; with fewer cores than
    workers, one core each, reused in turn."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else sorted(cores)
    share = max(len(cores) // tensor_parallel, 1)
    groups = []
    for worker in range(tensor_parallel):
        start = (worker * share) % len(cores)
        mine = cores[start : start + share]
        groups.append(",".join(str(core) for core in mine))
    return "|".join(groups)


def cpu_kv_cache_bytes(settings: TrainerSettings, model_path: str) -> int:
    """KV-cache bytes for every sequence of a step at full length, twice over (at least
    64 MiB): keys and values of every layer in float32, per token as `rlx plan` counts them."""
    from transformers import AutoConfig

    from rlx.plan.memory import kv_bytes_per_token
    from rlx.plan.shapes import ModelShape
    from rlx.recipe.model import episode_token_budget

    config = AutoConfig.from_pretrained(
        model_path, trust_remote_code=settings.model.trust_remote_code
    )
    shape = ModelShape.from_config(config.to_dict(), source=model_path)
    per_token = kv_bytes_per_token(shape, dtype="float32")
    rollout = settings.rollout
    tokens = (
        settings.batch.prompts_per_step
        * rollout.n
        * (settings.data.max_prompt_length + episode_token_budget(settings))
    )
    return max(2 * tokens * per_token, 64 * 2**20)
