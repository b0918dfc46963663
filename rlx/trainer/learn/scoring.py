"""Scoring responses: the log-prob of each response token under a causal LM and the entropy
of the distribution it was drawn from (ResponseScorer), and the critic's value before each
response token (response_values); over padded rows or the same sequences packed."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from rlx.plan.memory import chunk_tokens_for_vocab
from rlx.trainer.learn.models import packed_attention
from rlx.trainer.model.cpu_linear import linear
from rlx.trainer.model.prefill import prompt_groups, shared_prompt_cache
from rlx.trainer.model.traits import traits

if TYPE_CHECKING:
    from rlx.trainer.batch import SequenceBatch
    from rlx.trainer.packing import PackedRows


@dataclass(frozen=True)
class TokenScores:
    """Per response token, (B, R) each, zero on padding: log-prob of the token at the
    sampling temperature, and the entropy of that distribution (with a graph only when
    asked for)."""

    logprobs: Tensor
    entropy: Tensor


@dataclass(frozen=True)
class ScoreInputs:
    """What a ResponseScorer scores: a micro-batch's sequences at the sampling temperature,
    as padded rows (`rows`: ids, 2-D attention mask, prompt width and the response mask
    that says which tokens are scored) or, with `packed`, as the same sequences packed
    (rlx.trainer.packing: ids, positions, the indices scored and their targets, its 4-D mask
    or None, its layout), which then run instead of the padded rows. entropy_grad: whether
    the entropy keeps a graph. Made by ScoreInputs.of, which leaves the batch's per-token
    fields behind: with no floating-point tensor in it, DDP and FSDP hand it to the forward
    as it is."""

    rows: SequenceBatch
    temperature: float
    entropy_grad: bool
    packed: PackedRows | None = None

    @classmethod
    def of(
        cls,
        batch: SequenceBatch,
        temperature: float,
        *,
        entropy_grad: bool,
        packed: PackedRows | None = None,
    ) -> ScoreInputs:
        return cls(replace(batch, fields={}), temperature, entropy_grad, packed)


class ResponseScorer(nn.Module):
    """A causal LM as a function of ScoreInputs: the log-prob of each response
    token and the entropy of the distribution it was drawn from, at temperature T.

    Memory: only the hidden states of real response tokens reach the LM head, in chunks of
    `chunk_tokens`; with gradients on, each chunk is recomputed in the backward
    (torch.utils.checkpoint), so one chunk's (tokens x vocab) fp32 logits live at a time.

    Rows that hold the same prompt (GRPO's n samples per prompt) run it once: the distinct
    prompts go through the body first, each row gets its prompt's keys and values, and only
    the responses run on top. Gradients flow back through the shared keys and values, so the
    result is a full forward's up to float rounding. Everything runs as one forward of the LM
    (sharding.run_as_forward): one DDP forward when DDP wraps this module, one FSDP2 forward
    of the sharded root. `agree` (all ranks' AND) makes every rank take the same path, which
    FSDP's collective forwards need.
    """

    def __init__(
        self,
        lm: nn.Module,
        *,
        chunk_tokens: int | None = None,
        agree: Callable[[bool], bool] | None = None,
        adapter_off: bool = False,
    ):
        super().__init__()
        config = lm.config  # type: ignore[union-attr]
        if getattr(config, "final_logit_softcapping", None):
            raise ValueError(
                f"{type(lm).__name__} caps its logits (final_logit_softcapping), which the "
                "chunked log-probs do not apply; this trainer does not support it yet"
            )
        self.lm = lm
        vocab = config.vocab_size
        # About LOGITS_CHUNK_BYTES of fp32 logits at once, whatever the micro-batch holds.
        self.chunk_tokens = chunk_tokens or chunk_tokens_for_vocab(vocab)
        self.agree = agree
        # A LoRA policy scoring as its own reference: the base, with its adapters switched off.
        self.adapter_off = adapter_off

    def forward(self, inputs: ScoreInputs) -> tuple[Tensor, Tensor]:
        """(B, R) log-probs and entropies of inputs' response tokens, zero elsewhere: over its
        packed rows where it has them, else over its padded rows."""
        from rlx.trainer.learn.sharding import run_as_forward

        adapters = self.lm.disable_adapter() if self.adapter_off else contextlib.nullcontext()
        score = self._score if inputs.packed is None else self._score_packed
        with adapters:  # type: ignore[attr-defined]
            return run_as_forward(self.lm, score, inputs)

    def _can_share(self, rows: SequenceBatch) -> Any:
        prompt_width = rows.prompt_width
        width = rows.input_ids.shape[1] - prompt_width  # R
        groups = None
        if prompt_width > 0 and width > 1 and traits(self.lm).shares_prefill(self.lm.training):
            groups = prompt_groups(
                rows.input_ids[:, :prompt_width], rows.attention_mask[:, :prompt_width]
            )
        if self.agree is not None and not self.agree(groups is not None):
            return None
        return groups

    def _response_hidden(self, rows: SequenceBatch) -> Tensor:
        """(B, R, H) final hidden states at the positions that predict each response token.
        Call inside the LM's forward (see forward)."""
        body = self.lm.get_decoder()  # type: ignore[operator]
        input_ids, attention_mask = rows.input_ids, rows.attention_mask  # (B, P + R) each
        position_ids, prompt_width = rows.position_ids, rows.prompt_width
        width = input_ids.shape[1] - prompt_width  # R
        groups = self._can_share(rows)
        if groups is None:
            hidden = body(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=False,
            ).last_hidden_state  # (B, P + R, H)
            # position P - 1 + t predicts response token t
            return hidden[:, prompt_width - 1 : prompt_width - 1 + width]  # (B, R, H)
        cache, head = shared_prompt_cache(
            body, groups, input_ids[:, :prompt_width], attention_mask[:, :prompt_width]
        )  # head (B, 1, H) predicts response token 0
        tail = body(
            input_ids=input_ids[:, prompt_width:-1],
            attention_mask=attention_mask[:, :-1],
            position_ids=position_ids[:, prompt_width:-1],
            past_key_values=cache,
            use_cache=True,
        ).last_hidden_state  # (B, R - 1, H) predict response tokens 1..R-1
        return torch.cat([head, tail], dim=1)  # (B, R, H)

    def _score(self, inputs: ScoreInputs) -> tuple[Tensor, Tensor]:
        rows = inputs.rows
        hidden = self._response_hidden(rows)
        targets = rows.input_ids[:, rows.prompt_width :]  # (B, R)
        real_hidden = hidden[rows.response_mask]  # (N, H): padding never reaches the head
        real_targets = targets[rows.response_mask]  # (N,)
        return self._head_scores(real_hidden, real_targets, inputs)

    def _score_packed(self, inputs: ScoreInputs) -> tuple[Tensor, Tensor]:
        packed = inputs.packed
        assert packed is not None
        body = self.lm.get_decoder()  # type: ignore[operator]
        # No 2-D attention mask and no cache: the only calls that keep packed sequences apart
        # (packed_attention says which).
        hidden = body(
            input_ids=packed.input_ids,
            position_ids=packed.position_ids,
            use_cache=False,
            **packed_attention(body, packed.attention, packed.layout, packed.input_ids.device),
        ).last_hidden_state  # (k, T, H)
        real_hidden = hidden.flatten(0, 1)[packed.score_index]  # (N, H)
        real_targets = packed.input_ids.flatten()[packed.target_positions()]  # (N,)
        return self._head_scores(real_hidden, real_targets, inputs)

    def _head_scores(
        self, real_hidden: Tensor, real_targets: Tensor, inputs: ScoreInputs
    ) -> tuple[Tensor, Tensor]:
        """(N, H) hidden states of the scored tokens and their (N,) targets -> (B, R) log-probs
        and entropies, zero where inputs.rows.response_mask is False."""
        response_mask = inputs.rows.response_mask
        head = self.lm.get_output_embeddings()  # type: ignore[operator]
        logprobs, entropy = chunked_token_scores(
            real_hidden,
            head.weight,
            getattr(head, "bias", None),
            real_targets,
            temperature=inputs.temperature,
            entropy_grad=inputs.entropy_grad,
            chunk_tokens=self.chunk_tokens,
        )  # (N,) each
        zeros = torch.zeros(response_mask.shape, dtype=torch.float32, device=real_hidden.device)
        return zeros.masked_scatter(response_mask, logprobs), zeros.masked_scatter(
            response_mask, entropy
        )  # (B, R) each


def _chunk_scores(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    temperature: float,
    entropy_grad: bool,
) -> tuple[Tensor, Tensor]:
    """Log-probs and entropies of one chunk of tokens: hidden (n, H), targets (n,) -> (n,)."""
    logits = linear(hidden, weight, bias).float()  # (n, V): as the model's own linears run
    if temperature != 1.0:
        logits = logits / temperature
    logz = torch.logsumexp(logits, dim=-1)  # (n,)
    logprobs = logits.gather(-1, targets[:, None]).squeeze(-1) - logz  # (n,)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        # H = logsumexp(z) - sum_v p_v z_v
        entropy = logz - torch.einsum("nv,nv->n", torch.softmax(logits, dim=-1), logits)
    return logprobs, entropy


def chunked_token_scores(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    *,
    temperature: float,
    entropy_grad: bool,
    chunk_tokens: int,
) -> tuple[Tensor, Tensor]:
    """Log-probs of `targets` and entropies under softmax((hidden @ weight.T + bias) / T),
    chunk by chunk of tokens: hidden (N, H), targets (N,) -> (N,), (N,) fp32. With gradients
    on, each chunk's logits are recomputed in the backward instead of kept."""
    from torch.utils.checkpoint import checkpoint

    logprobs, entropies = [], []
    for start in range(0, hidden.shape[0], chunk_tokens):
        piece = (
            hidden[start : start + chunk_tokens],
            weight,
            bias,
            targets[start : start + chunk_tokens],
            temperature,
            entropy_grad,
        )
        if torch.is_grad_enabled():
            lp, ent = checkpoint(_chunk_scores, *piece, use_reentrant=False)
        else:
            lp, ent = _chunk_scores(*piece)
        logprobs.append(lp)
        entropies.append(ent)
    if not logprobs:
        empty = hidden.new_zeros((0,), dtype=torch.float32)
        return empty, empty
    return torch.cat(logprobs), torch.cat(entropies)


def score_responses(
    scorer: nn.Module,
    batch: SequenceBatch,
    temperature: float,
    *,
    entropy_grad: bool,
    packed: PackedRows | None = None,
) -> TokenScores:
    """(B, R) log-probs and entropies of a batch's responses, from a ResponseScorer (or DDP of
    one); with `packed`, the same sequences run packed (no padding)."""
    inputs = ScoreInputs.of(batch, temperature, entropy_grad=entropy_grad, packed=packed)
    logprobs, entropy = scorer(inputs)
    return TokenScores(logprobs, entropy)


def response_values(
    critic: nn.Module, batch: SequenceBatch, packed: PackedRows | None = None
) -> Tensor:
    """V(state before response token t) for every t: (B, R); with `packed`, the same
    sequences run packed (zero off the response mask)."""
    if packed is not None:
        values = critic(
            packed.input_ids, packed.attention, packed.position_ids, packed.layout
        )  # (k, T)
        scored = values.flatten()[packed.score_index]  # (N,)
        zeros = torch.zeros(batch.response_mask.shape, dtype=scored.dtype, device=scored.device)
        return zeros.masked_scatter(batch.response_mask, scored)  # (B, R)
    values = critic(batch.input_ids, batch.attention_mask, batch.position_ids)  # (B, P + R)
    return values[:, batch.prompt_width - 1 : -1]  # (B, R)
