"""Reduction of a per-token loss (B, T) to the scalar that is back-propagated.

A minibatch is often split into micro-batches (gradient accumulation, data parallelism).
Dividing each micro-batch by its own token or sequence count would weight tokens unequally,
so every mode divides by a count over the WHOLE minibatch (num_global_tokens,
num_global_seqs; see loss_denominators). Summing the micro-batch losses then gives exactly
the loss and gradient of one pass. Under DDP, which averages gradients over ranks, multiply
the loss by the world size. Left as None, the counts are those of the tensors given. A
constant normaliser (seq-mean-token-sum-norm's token_budget) is the same in every micro-batch
by construction; the padded length of a micro-batch is not, so it never stands in for one.
"""

from collections.abc import Mapping
from types import MappingProxyType
from typing import Protocol

import torch
from torch import Tensor

from rlx.trainer.algos.common import lookup
from rlx.trainer.algos.masked import masked_sum

Denominator = float | Tensor | None


def loss_denominators(mask: Tensor) -> tuple[Tensor, Tensor]:
    """(number of valid tokens, number of sequences with at least one valid token) of mask."""
    token_counts = mask.to(torch.int64).sum(dim=-1)  # (B,)
    return token_counts.sum(), (token_counts > 0).sum()


def _denominator(global_count: Denominator, local_count: Tensor) -> Tensor:
    count = local_count if global_count is None else torch.as_tensor(global_count)
    return count.clamp(min=1)


def _token_mean(
    loss: Tensor,
    mask: Tensor,
    num_global_tokens: Denominator,
    num_global_seqs: Denominator,
    *,
    token_budget: float | None = None,
) -> Tensor:
    del token_budget
    del num_global_seqs
    num_tokens, _ = loss_denominators(mask)
    return masked_sum(loss, mask) / _denominator(num_global_tokens, num_tokens)


def _seq_mean_token_mean(
    loss: Tensor,
    mask: Tensor,
    num_global_tokens: Denominator,
    num_global_seqs: Denominator,
    *,
    token_budget: float | None = None,
) -> Tensor:
    del token_budget
    del num_global_tokens
    _, num_seqs = loss_denominators(mask)
    token_counts = mask.to(loss.dtype).sum(dim=-1)  # (B,)
    seq_losses = masked_sum(loss, mask, dim=-1) / token_counts.clamp(min=1)  # (B,)
    return seq_losses.sum() / _denominator(num_global_seqs, num_seqs)


def _seq_mean_token_sum(
    loss: Tensor,
    mask: Tensor,
    num_global_tokens: Denominator,
    num_global_seqs: Denominator,
    *,
    token_budget: float | None = None,
) -> Tensor:
    del token_budget
    del num_global_tokens
    _, num_seqs = loss_denominators(mask)
    seq_losses = masked_sum(loss, mask, dim=-1)  # (B,)
    return seq_losses.sum() / _denominator(num_global_seqs, num_seqs)


def _seq_mean_token_sum_norm(
    loss: Tensor,
    mask: Tensor,
    num_global_tokens: Denominator,
    num_global_seqs: Denominator,
    *,
    token_budget: float | None = None,
) -> Tensor:
    del num_global_tokens
    if token_budget is None or token_budget <= 0:
        raise ValueError(
            "seq-mean-token-sum-norm divides every response's token sum by a constant: pass "
            f"token_budget, the response budget (a positive number), got {token_budget}"
        )
    _, num_seqs = loss_denominators(mask)
    seq_losses = masked_sum(loss, mask, dim=-1) / token_budget  # (B,)
    return seq_losses.sum() / _denominator(num_global_seqs, num_seqs)


class AggregationFn(Protocol):
    """Common signature of AGGREGATIONS entries: (loss, mask, global tokens, global seqs)."""

    def __call__(
        self,
        loss: Tensor,
        mask: Tensor,
        num_global_tokens: Denominator,
        num_global_seqs: Denominator,
        *,
        token_budget: float | None = None,
    ) -> Tensor: ...


AGGREGATIONS: Mapping[str, AggregationFn] = MappingProxyType(
    {
        "token-mean": _token_mean,
        "seq-mean-token-mean": _seq_mean_token_mean,
        "seq-mean-token-sum": _seq_mean_token_sum,
        "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
    }
)


def get_aggregation(mode: str) -> AggregationFn:
    return lookup(AGGREGATIONS, mode, "loss aggregation mode")


def aggregate_loss(
    loss: Tensor,
    mask: Tensor,
    mode: str = "token-mean",
    *,
    num_global_tokens: Denominator = None,
    num_global_seqs: Denominator = None,
    token_budget: float | None = None,
) -> Tensor:
    """Reduce a per-token loss (B, T) to a scalar.

    token-mean: sum over valid tokens / global number of valid tokens (every token weighs the
    same, long answers weigh more). seq-mean-token-mean: each sequence's mean over its tokens,
    summed / global number of sequences (every answer weighs the same). seq-mean-token-sum:
    each sequence's sum over its tokens, summed / global number of sequences.
    seq-mean-token-sum-norm: each sequence's sum over its tokens divided by token_budget, a
    constant (the response budget), summed / global number of sequences: Dr. GRPO's
    normaliser (Liu et al. 2025, "Understanding R1-Zero-Like Training"), which neither favours
    short correct answers nor lets long wrong ones off lightly, as a per-response length does.
    """
    return get_aggregation(mode)(
        loss, mask, num_global_tokens, num_global_seqs, token_budget=token_budget
    )
