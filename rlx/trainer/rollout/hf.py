"""Rollouts with transformers' `generate` (CPU, or a GPU without vLLM): the engine behind
`engine: hf`, and the one a colocated worker runs over the policy module itself."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rlx.trainer.batch import RolloutBatch, pad_responses
from rlx.trainer.model.cpu_linear import use_onednn
from rlx.trainer.model.decode import LeanDecoder, grow_in_place
from rlx.trainer.model.traits import traits, transformers_model
from rlx.trainer.rollout.base import (
    EngineSite,
    RolloutEngine,
    SamplingArgs,
    check_sampling_args,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from rlx.recipe.model import LoraSettings, TrainerSettings


def mask_after_eos(response_ids: torch.Tensor, eos_ids: Sequence[int]) -> torch.Tensor:
    """True up to and including each row's first EOS, False after it."""
    is_eos = torch.isin(response_ids, torch.tensor(eos_ids, device=response_ids.device))
    eos_before = is_eos.long().cumsum(dim=1) - is_eos.long()  # (N, R) EOS strictly earlier
    return eos_before == 0


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Set to -inf every token outside the smallest set whose probability reaches top_p."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V)
    probs = sorted_logits.softmax(dim=-1)
    mass_above = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
    drop_sorted = mass_above >= top_p  # the most likely token always stays (mass_above = 0)
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, -math.inf)


class _SamplingDistribution:
    """The logits processor that defines what `generate` samples from, and records it.

    transformers runs its own warpers after user processors, so the engine turns all of
    them off and does min-new-tokens, temperature and top-p here, last in the chain. The
    token drawn at step t is known only at step t+1 (it is then input_ids[:, -1]), so the
    log-softmax of one step is kept until the next call gathers the drawn token from it.
    """

    def __init__(
        self,
        prompt_width: int,
        eos_ids: Sequence[int],
        min_new_tokens: int,
        temperature: float,
        top_p: float,
    ):
        self.prompt_width = prompt_width
        self.eos_ids = list(eos_ids)
        self.min_new_tokens = min_new_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.sampled_logprobs: list[torch.Tensor] = []  # one (B,) per step
        self._pending: torch.Tensor | None = None  # (B, V) log-probs of the last step

    def warp(self, step: int, scores: torch.Tensor) -> torch.Tensor:
        """(B, V) logits of response position `step` -> the logits sampled from: EOS held
        back before min_new_tokens, then the temperature, then top-p."""
        scores = scores.float()
        if step < self.min_new_tokens:
            scores = scores.clone()  # (B, V) never write into the model's own buffer
            scores[:, self.eos_ids] = -math.inf
        return top_p_filter(scores / self.temperature, self.top_p)  # (B, V)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self._pending is not None:
            drawn = input_ids[:, -1:]  # (B, 1)
            self.sampled_logprobs.append(self._pending.gather(1, drawn).squeeze(1))
        scores = self.warp(input_ids.shape[1] - self.prompt_width, scores)
        self._pending = torch.log_softmax(scores, dim=-1)
        return scores

    def logprobs_of(self, response_ids: torch.Tensor) -> torch.Tensor:
        """(B, R) log-probs of the drawn tokens, once generation is over."""
        width = response_ids.shape[1]
        values = self.sampled_logprobs[:width]
        if len(values) < width and self._pending is not None:
            values.append(self._pending.gather(1, response_ids[:, -1:]).squeeze(1))
        return torch.stack(values, dim=1)


class HFEngine(RolloutEngine):
    """Rollouts with transformers' `generate`; works on CPU and as a GPU fallback.

    `model` is a loaded causal LM (used as is, not copied: load_weights writes into it;
    the engine puts it in eval mode once) or a folder/hub name to load. The engine
    replaces the model's generation config, so sampling defaults shipped with a checkpoint
    (temperature, top_k, repetition penalty) never apply: only the arguments of `generate`
    do. Prompts are left-padded into batches of at most max_batch_size rows (all rows at
    once when None).
    """

    def __init__(
        self,
        model: PreTrainedModel | str | Path,
        *,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | str | None = None,
        max_batch_size: int | None = None,
        collective: Callable[[bool], bool] | None = None,
        lora: LoraSettings | None = None,
    ):
        """collective: for a model sharded over ranks (FSDP), the AND of a flag over all
        ranks. Every rank then runs as many forwards as the longest generation needs
        (transformers' synced_gpus) and takes the same prefill path. lora: the policy
        trains these adapters; a loaded model gets them too (pushes then carry only
        them), starting as the policy's do: switched off in effect (B is zero)."""
        from transformers import AutoModelForCausalLM, GenerationConfig

        if isinstance(dtype, str) and dtype != "auto":
            dtype = getattr(torch, dtype)  # "bfloat16" -> torch.bfloat16
        if isinstance(model, (str, Path)):
            model = AutoModelForCausalLM.from_pretrained(str(model), dtype=dtype or "auto")
        elif isinstance(dtype, torch.dtype):
            model = model.to(dtype=dtype)
        if lora is not None and not hasattr(model, "peft_config"):
            from rlx.trainer.model.lora import add_adapters

            model = add_adapters(model, lora)
        if device is not None:
            model = model.to(device)
        self.model = model.eval()
        self.device = next(model.parameters()).device
        if self.device.type == "cpu" and collective is None:
            use_onednn(model)  # where this CPU takes oneDNN: AVX-512 (cpu_linear.py)
        eos = eos_token_id
        if eos is None:
            eos = model.generation_config.eos_token_id
        if eos is None:
            eos = model.config.eos_token_id
        if eos is None:
            raise ValueError("the model names no EOS token; pass eos_token_id")
        self.eos_ids: list[int] = [eos] if isinstance(eos, int) else list(eos)
        if pad_token_id is None:
            pad_token_id = model.generation_config.pad_token_id
        if pad_token_id is None:
            pad_token_id = getattr(model.config, "pad_token_id", None)
        # Without a pad token, EOS pads: masks come from positions, never from token values.
        self.pad_token_id: int = self.eos_ids[0] if pad_token_id is None else int(pad_token_id)
        self.max_batch_size = max_batch_size
        self.collective = collective
        # A LoRA policy (peft's wrapper) generates with its base model's generation config.
        transformers_model(model).generation_config = GenerationConfig(
            eos_token_id=self.eos_ids, pad_token_id=self.pad_token_id
        )
        self._version = 0
        self._target_tensors: dict[str, torch.Tensor] | None = None
        self.traits = traits(model)  # read once: what the loaded model can share and decode
        self.decoder, self.decode_note = self._lean_decoder(model)

    def _lean_decoder(self, model: PreTrainedModel) -> tuple[LeanDecoder | None, str | None]:
        """The decode step from the weights directly (decode.py) where it runs this model and
        matches transformers' forward; else (None, the one line that says why not). A model
        sharded over ranks runs transformers' forward, which gathers its weights."""
        if self.collective is not None or self.traits.stateful:
            return None, None
        decoder, reason = LeanDecoder.for_model(model, self.traits)
        if decoder is not None:
            gap = decoder.check(model)
            if gap <= decoder.tolerance():
                return decoder, None
            reason = f"its own decode step's logits differ from the forward's by {gap:.1e}"
        return None, f"rollouts: the HF engine decodes through transformers' forward ({reason})"

    @classmethod
    def options_from(cls, settings: TrainerSettings, site: EngineSite) -> dict[str, Any]:
        """The engine's device, and a LoRA policy's adapters (the engine's model gets them
        too)."""
        return {"device": site.device, "lora": settings.model.lora}

    def notes(self) -> list[str]:
        return [] if self.decode_note is None else [self.decode_note]

    @property
    def weight_version(self) -> int:
        return self._version

    def _left_pad(self, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, ids in enumerate(prompts):
            input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, width - len(ids) :] = 1
        return input_ids.to(self.device), attention_mask.to(self.device)

    @torch.no_grad()
    def _generate_chunk(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingArgs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One response per row of prompts (the rows already repeat each prompt n times):
        (B, R) response tokens, padded after each row's EOS, and (B, R) their log-probs."""
        input_ids, attention_mask = self._left_pad(prompts)  # (B, P)
        greedy = sampling.temperature == 0  # the most likely token; log-probs of the model's own
        distribution = _SamplingDistribution(
            input_ids.shape[1],
            self.eos_ids,
            sampling.min_new_tokens,
            1.0 if greedy else sampling.temperature,
            1.0 if greedy else sampling.top_p,
        )
        if self.traits.stateful:
            return self._generate_with_transformers(
                input_ids, attention_mask, sampling, distribution, greedy
            )
        return self._decode(input_ids, attention_mask, sampling, distribution, greedy)

    def _decode(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        sampling: SamplingArgs,
        distribution: _SamplingDistribution,
        greedy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample token by token from a key/value cache, dropping each row from the batch
        (and its keys and values from the cache) once it has drawn EOS: a step costs what its
        unfinished rows cost, where transformers' `generate` runs every row to the longest
        (RL's response lengths are skewed: a few long ones, most short). A sharded model's
        ranks run forwards together until every rank's rows are done; a rank whose rows are
        all done keeps one finished row going, its tokens dropped."""
        rows = input_ids.shape[0]
        cache, logits = self._prefill(input_ids, attention_mask)  # logits: (B, V)
        grow_in_place(cache, input_ids.shape[1] + sampling.max_new_tokens)
        generation = None
        if self.decoder is not None:
            generation = self.decoder.prepare(input_ids.shape[1] + sampling.max_new_tokens, rows)
        positions = attention_mask.sum(dim=1, keepdim=True)  # (B, 1): the next token's
        mask = attention_mask
        alive = torch.arange(rows, device=self.device)  # (A,) batch row of each cache row
        live = torch.ones(rows, dtype=torch.bool, device=self.device)  # (A,) not a stand-in
        tokens = torch.full(
            (rows, sampling.max_new_tokens), self.pad_token_id, dtype=torch.long
        )  # (B, R) on the host
        logprobs = torch.zeros((rows, sampling.max_new_tokens), dtype=torch.float32)
        eos = torch.tensor(self.eos_ids, device=self.device)
        width = 0  # response positions written so far
        step = 0
        while True:
            scores = distribution.warp(step, logits)  # (A, V)
            step_logprobs = torch.log_softmax(scores, dim=-1)
            if greedy:
                drawn = scores.argmax(dim=-1, keepdim=True)  # (A, 1)
            else:
                drawn = torch.multinomial(step_logprobs.exp(), num_samples=1)
            if step < sampling.max_new_tokens and bool(live.any()):
                taken = step_logprobs.gather(1, drawn).squeeze(1)  # (A,)
                kept = alive[live].cpu()
                tokens[kept, step] = drawn.squeeze(1)[live].cpu()
                logprobs[kept, step] = taken[live].float().cpu()
                width = step + 1
            live = live & ~torch.isin(drawn.squeeze(1), eos)
            if step + 1 >= sampling.max_new_tokens:
                live = torch.zeros_like(live)
            done = not bool(live.any())
            if self.collective is not None:
                done = self.collective(done)  # every rank's forwards until all are done
            if done:
                break
            keep = live.nonzero().squeeze(1)  # (A',)
            if len(keep) == 0:  # this rank is done, others are not: one row stands in
                keep = torch.zeros(1, dtype=torch.long, device=self.device)
            if len(keep) < len(alive):
                cache.batch_select_indices(keep)
                alive, live, drawn = alive[keep], live[keep], drawn[keep]
                mask, positions = mask[keep], positions[keep]
            mask = torch.cat([mask, mask.new_ones((len(alive), 1))], dim=1)
            if self.decoder is not None and generation is not None:
                logits = self.decoder.step(generation, drawn, positions, mask, cache)  # (A, V)
            else:
                out = self.model(
                    input_ids=drawn,
                    attention_mask=mask,
                    position_ids=positions,
                    past_key_values=cache,
                    use_cache=True,
                )
                logits = out.logits[:, -1]  # (A, V)
            positions = positions + 1
            step += 1
        return tokens[:, :width], logprobs[:, :width]

    def _prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple:
        """The cache after every row's prompt, and the logits of its first response token:
        (cache, (B, V)). The n rows of a prompt share its prefill: each distinct prompt runs
        once and every row gets its keys and values (see ModelTraits.shares_prefill)."""
        from transformers import DynamicCache

        from rlx.trainer.model.prefill import prompt_groups, shared_prompt_cache

        shares = self.traits.shares_prefill(self.model.training)
        groups = prompt_groups(input_ids, attention_mask) if shares else None
        if self.collective is not None and not self.collective(groups is not None):
            groups = None  # a sharded model's ranks take one path: the prefill is a forward
        if groups is not None:
            cache, head = shared_prompt_cache(self.model, groups, input_ids, attention_mask)
            return cache, head[:, -1]
        cache = DynamicCache(config=self.model.config)
        positions = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)  # (B, P)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return cache, out.logits[:, -1]

    def _generate_with_transformers(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        sampling: SamplingArgs,
        distribution: _SamplingDistribution,
        greedy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' `generate`, for models whose state is not a key/value cache that
        rows can be dropped from (recurrent ones): every row runs to the longest."""
        from transformers import LogitsProcessorList

        sequences = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=not greedy,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=sampling.max_new_tokens,
            logits_processor=LogitsProcessorList([distribution]),
            synced_gpus=self.collective is not None,
        )
        response = sequences[:, input_ids.shape[1] :]  # (B, R)
        return response.cpu(), distribution.logprobs_of(response).float().cpu()

    def take_part(self, max_new_tokens: int) -> None:
        """A rank without prompts of its own joins the other ranks' generate (collective
        engines only): it runs the same forwards on one placeholder row and keeps nothing."""
        if self.collective is None:
            return
        self._generate_chunk([[self.pad_token_id]], SamplingArgs(1, max_new_tokens))

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        sampling: SamplingArgs,
        *,
        seed: int | None = None,
    ) -> RolloutBatch:
        check_sampling_args(prompt_token_ids, sampling)
        n = sampling.n
        rows = [list(ids) for ids in prompt_token_ids for _ in range(n)]
        chunk = self.max_batch_size or len(rows)
        responses: list[list[int]] = []
        logprobs: list[list[float]] = []
        finished: list[bool] = []
        devices = [self.device] if self.device.type == "cuda" else []
        # A private RNG stream, so a seeded call neither depends on nor moves global state.
        with torch.random.fork_rng(devices=devices, enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            for start in range(0, len(rows), chunk):
                ids, lps = self._generate_chunk(rows[start : start + chunk], sampling)
                mask = mask_after_eos(ids, self.eos_ids)  # (B, R)
                lengths = mask.sum(dim=1).tolist()
                for row, length in enumerate(lengths):
                    responses.append(ids[row, :length].tolist())
                    logprobs.append(lps[row, :length].tolist())
                    finished.append(length > 0 and responses[-1][-1] in self.eos_ids)
        response_ids, response_mask, values = pad_responses(responses, logprobs, self.pad_token_id)
        return RolloutBatch(
            prompt_ids=rows,
            response_ids=response_ids,
            response_mask=response_mask,
            logprobs=values,
            finished=torch.tensor(finished, dtype=torch.bool),
            n=n,
            pad_token_id=self.pad_token_id,
            weight_version=self._version,
        )

    @torch.no_grad()
    def load_weight_bucket(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> int:
        targets = self._targets()
        loaded = 0
        for name, tensor in bucket:
            if name not in targets:
                known = ", ".join(list(targets)[:5])
                raise KeyError(
                    f"load_weights: the model has no tensor {name!r} (it has {known}, ...)"
                )
            target = targets[name]
            if target.shape != tensor.shape:
                raise ValueError(
                    f"load_weights: {name!r} has shape {tuple(tensor.shape)}, "
                    f"the model expects {tuple(target.shape)}"
                )
            target.data.copy_(tensor.to(device=target.device, dtype=target.dtype))
            loaded += 1
        return loaded

    @property
    def push_device(self) -> torch.device:
        return self.device

    def _targets(self) -> dict[str, torch.Tensor]:
        if self._target_tensors is None:
            self._target_tensors = self.model.state_dict(keep_vars=True)
        return self._target_tensors

    def finish_weights(self, version: int) -> None:
        self._version = int(version)

    def close(self) -> None:
        del self.model
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @torch.no_grad()
    def logprob_probe(self, prompt_ids: Sequence[int], response_ids: Sequence[int]) -> float:
        if not prompt_ids or not response_ids:
            raise ValueError("logprob_probe needs a non-empty prompt and response")
        ids = torch.tensor([list(prompt_ids) + list(response_ids)], device=self.device)
        logits = self.model(input_ids=ids).logits.float()  # (1, T, V)
        # The logit at position t predicts token t+1: the response starts at len(prompt).
        predicting = logits[0, len(prompt_ids) - 1 : -1]  # (R, V)
        logprobs = torch.log_softmax(predicting, dim=-1)
        target = ids[0, len(prompt_ids) :]
        return float(logprobs.gather(1, target[:, None]).sum().item())
