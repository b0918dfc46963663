"""The vLLM rollout engine (GPU). vllm is imported only here, when this engine is chosen.

Uses vLLM's offline API: `LLM(...)`, `SamplingParams(...)`, `LLM.generate` on token-id
prompts, and `LLM.apply_model` to load new weights into the model on every worker (vLLM's
own `load_weights` shards them for tensor parallelism). Log-probs are requested as
"processed_logprobs" (after temperature and top-p), the same distribution HFEngine reports.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from rlx.trainer.rollout import (
    NamedTensors,
    RolloutBatch,
    RolloutEngine,
    check_sampling_args,
    pad_responses,
)

INSTALL_HINT = 'the vllm rollout engine needs vLLM: pip install "rlx[vllm]" (on a CUDA machine)'


def _import_vllm():
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(f"{INSTALL_HINT} ({exc})") from exc
    return vllm


def _load_into_model(model: torch.nn.Module, weights: list[tuple[str, torch.Tensor]]) -> int:
    """Runs inside each vLLM worker (module level so it pickles by reference)."""
    model.load_weights(weights=iter(weights))
    return len(weights)


class VLLMEngine(RolloutEngine):
    """Rollouts with vLLM. llm_options go to `vllm.LLM` (tensor_parallel_size,
    gpu_memory_utilization, max_model_len, enforce_eager, ...).

    logprobs_mode needs vLLM >= 0.10.2; pass logprobs_mode=None on older versions, which
    report log-probs of the raw (untempered) distribution instead.
    """

    def __init__(self, model_path: str | Path, *, dtype: str = "auto", **llm_options: Any):
        vllm = _import_vllm()
        self._vllm = vllm
        options = {"logprobs_mode": "processed_logprobs", **llm_options}
        if options["logprobs_mode"] is None:
            del options["logprobs_mode"]
        # apply_model ships a function to the engine's worker processes; vLLM pickles
        # callables only when allowed. The workers are this job's own children.
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        self.llm = vllm.LLM(model=str(model_path), dtype=dtype, **options)
        tokenizer = self.llm.get_tokenizer()
        self.pad_token_id: int = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )
        self._version = 0

    @property
    def weight_version(self) -> int:
        return self._version

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
        if seed is None:
            requests = [{"prompt_token_ids": list(ids)} for ids in prompt_token_ids]
            sampling: Any = params(n=n)
        else:
            # One seeded request per sample: each row gets its own reproducible stream.
            requests = [
                {"prompt_token_ids": list(ids)} for ids in prompt_token_ids for _ in range(n)
            ]
            sampling = [params(n=1, seed=seed * 1_000_003 + row) for row in range(len(requests))]
        outputs = self.llm.generate(requests, sampling, use_tqdm=False)

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

    def load_weights(self, weights: NamedTensors, version: int) -> None:
        items = weights.items() if isinstance(weights, Mapping) else weights
        named = [(name, tensor.detach().cpu()) for name, tensor in items]
        if not named:
            raise ValueError("load_weights: no tensors given")
        self.llm.apply_model(functools.partial(_load_into_model, weights=named))
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

    def close(self) -> None:
        del self.llm
