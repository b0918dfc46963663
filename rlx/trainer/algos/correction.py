"""Rollout correction: importance weights for tokens the engine sampled and the learner trains on.

The engine that drew a response (vLLM or the HF engine, often bf16 with its own kernels, maybe
a few weight versions old) and the learner that trains on it (its old log-probs, pi_old) score
the same token differently. Tokens come from the engine's mu, the loss assumes pi_old, so each
token's term is weighted by rho = pi_old(y) / mu(y), in log space log rho = logp_old - logp_mu.
Three levels say whose ratio a token gets:
  token      rho_t, its own ratio: unbiased per token, the weight of truncated IS (TIS, Yao et
             al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
             Training"; verl, OpenRLHF) and of IcePop's token mask (Ring-1T, 2025);
  sequence   prod_t rho_t, the whole response's ratio: the unbiased weight of a sequence-level
             policy gradient, whose variance grows with length (verl's sequence IS, TRL's
             sequence mask);
  geometric  exp(mean_t log rho_t), the per-token geometric mean: a length-normalised sequence
             ratio, biased but of bounded spread (SkyRL's geometric mask; GSPO's ratio).
and two actions what happens outside the bounds [low, high]:
  truncate   the weight is clamped into [low, high] (low 0: TIS, only large weights are cut);
  mask       the weight is kept inside the bounds and 0 outside (the token or the whole
             response drops out of the loss: IcePop's calibrated mask, a rejection).
Decoupled PPO's behaviour weight (losses.behavior_weights) is this rule at the token level,
truncated at its cap. Where engine and learner agree, log rho is exactly 0 on every token, so
every level gives weight exp(0) = 1, which any bounds with low <= 1 <= high keep: the
correction is then a no-op to the bit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch
from torch import Tensor

from rlx.recipe.correction import correction_bounds_problem
from rlx.trainer.algos.common import MAX_LOG_RATIO, Metrics, lookup
from rlx.trainer.algos.masked import masked_mean, masked_sum


def _token_log_weight(log_rho: Tensor, valid: Tensor) -> Tensor:
    del valid
    return log_rho  # (B, T)


def _sequence_log_weight(log_rho: Tensor, valid: Tensor) -> Tensor:
    return masked_sum(log_rho, valid, dim=-1).unsqueeze(-1).expand_as(log_rho)  # (B, T)


def _geometric_log_weight(log_rho: Tensor, valid: Tensor) -> Tensor:
    return masked_mean(log_rho, valid, dim=-1).unsqueeze(-1).expand_as(log_rho)  # (B, T)


LogWeightFn = Callable[[Tensor, Tensor], Tensor]

CORRECTION_LEVELS: Mapping[str, LogWeightFn] = MappingProxyType(
    {
        "token": _token_log_weight,
        "sequence": _sequence_log_weight,
        "geometric": _geometric_log_weight,
    }
)


def _truncate(raw: Tensor, low: float, high: float) -> tuple[Tensor, Tensor]:
    return raw.clamp(low, high), (raw < low) | (raw > high)


def _mask(raw: Tensor, low: float, high: float) -> tuple[Tensor, Tensor]:
    outside = (raw < low) | (raw > high)  # (B, T)
    return torch.where(outside, 0.0, raw), outside


ActionFn = Callable[[Tensor, float, float], tuple[Tensor, Tensor]]

# action -> (the weights and which tokens it changed, the metric naming the changed share)
CORRECTION_ACTIONS: Mapping[str, tuple[ActionFn, str]] = MappingProxyType(
    {"truncate": (_truncate, "truncated_fraction"), "mask": (_mask, "masked_fraction")}
)


def rollout_correction_weights(
    learner_logp: Tensor,
    engine_logp: Tensor,
    mask: Tensor,
    *,
    level: str = "token",
    action: str = "truncate",
    low: float = 0.0,
    high: float = 2.0,
) -> tuple[Tensor, Metrics]:
    """Per-token weights pi_old / mu at `level`, with `action` applied outside [low, high].

    learner_logp (pi_old, the learner's log-probs before the update), engine_logp (mu, the
    sampling engine's), mask: (B, T). Returns the weights (B, T), detached, 0 on padding (which
    may hold anything, inf and NaN included), and detached metrics over valid tokens:
    mismatch/weight_mean (the raw weight's mean, before the action: 1 where nothing differs,
    its expectation under mu is 1 at the token level) and mismatch/truncated_fraction or
    mismatch/masked_fraction (the share of tokens the action changed). With no valid token the
    metrics are 0, not NaN: the learner merges them weighted by token counts, and 0 x NaN
    would poison the step's figure.
    """
    problem = correction_bounds_problem(low, high)
    if problem is not None:
        raise ValueError(problem)
    log_weight_of = lookup(CORRECTION_LEVELS, level, "rollout correction level")
    act, changed_name = lookup(CORRECTION_ACTIONS, action, "rollout correction action")
    with torch.no_grad():
        valid = mask.bool()  # (B, T)
        log_rho = torch.where(valid, learner_logp - engine_logp, 0.0)  # (B, T)
        # A sequence's log ratio sums many tokens: clamped like a token's, so exp stays finite.
        log_weight = log_weight_of(log_rho, valid).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)  # (B, T)
        raw = log_weight.exp()  # (B, T)
        weight, changed = act(raw, low, high)  # (B, T) each
        weight = torch.where(valid, weight, 0.0)  # (B, T)
        metrics: Metrics = {
            "mismatch/weight_mean": masked_mean(raw, valid),
            "mismatch/weight_sq_mean": masked_mean(raw.square(), valid),
            f"mismatch/{changed_name}": masked_mean(changed.to(raw.dtype), valid),
        }
    return weight, metrics
