"""Advantage estimators: GAE with a critic; group baselines (GRPO, RLOO) and REINFORCE++'s
batch-normalised returns without one."""

import functools
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Protocol

import torch
from torch import Tensor

from rlx.trainer.algos.common import lookup
from rlx.trainer.algos.masked import masked_sum, masked_whiten


@torch.no_grad()
def compute_gae(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, gae_lambda: float
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016), per token.

    rewards, values, mask: (B, T). Returns (advantages, returns), each (B, T), zero on padding,
    with returns = advantages + values on valid tokens (the critic's regression target).
    The value after the last valid token is 0: the response is over, nothing is bootstrapped.
    Masked tokens are not actions: the recursion steps over them, so rewards and values sitting
    on padding never reach a valid token.
    """
    dtype = torch.promote_types(rewards.dtype, values.dtype)
    rewards, values, valid = rewards.to(dtype), values.to(dtype), mask.bool()
    batch_size, num_tokens = rewards.shape
    next_value = rewards.new_zeros(batch_size)  # (B,) V of the next valid token
    next_advantage = rewards.new_zeros(batch_size)  # (B,)
    advantages = torch.zeros_like(rewards)  # (B, T)
    for t in reversed(range(num_tokens)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]  # (B,) TD error
        advantage = delta + gamma * gae_lambda * next_advantage  # (B,)
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        next_advantage = torch.where(valid[:, t], advantage, next_advantage)
        advantages[:, t] = torch.where(valid[:, t], advantage, 0.0)
    returns = torch.where(valid, advantages + values, 0.0)  # (B, T)
    return advantages, returns


def _groups(scores: Tensor, group_size: int) -> Tensor:
    if group_size < 2:
        raise ValueError(
            f"group_size must be at least 2 for a group baseline, got {group_size}: "
            "a single response per prompt has nothing to be compared with; "
            "sample more responses per prompt or use 'gae' with a critic"
        )
    if scores.dim() != 1 or scores.numel() % group_size != 0:
        raise ValueError(
            f"scores must be 1-D with a length divisible by group_size={group_size}, "
            f"got shape {tuple(scores.shape)}"
        )
    return scores.view(-1, group_size)  # (P, G) responses of one prompt are contiguous


def grpo_advantages(
    scores: Tensor,
    group_size: int,
    norm_by_std: bool = True,
    eps: float = 1e-6,
    valid: Tensor | None = None,
) -> Tensor:
    """GRPO outcome advantages (Shao et al. 2024): score minus its group's mean, divided by the
    group's (unbiased) std when norm_by_std. scores: (B,) with B = prompts * group_size.
    A group whose scores are all equal gets zero advantages (eps keeps 0 / 0 away).
    valid (B,) bool: the mean and std are the valid members' alone (a std of 0 with one),
    and an invalid row's advantage is 0 (its score, NaN or not, is never read)."""
    grouped = _groups(scores, group_size)  # (P, G)
    if valid is None:
        advantages = grouped - grouped.mean(dim=1, keepdim=True)  # (P, G)
        if norm_by_std:
            advantages = advantages / (grouped.std(dim=1, keepdim=True) + eps)  # (P, G)
        return advantages.reshape(-1)  # (B,)
    ok = valid.reshape(-1, group_size)  # (P, G)
    kept = torch.where(ok, grouped, 0.0)  # (P, G) NaN-free
    count = ok.sum(dim=1, keepdim=True)  # (P, 1)
    advantages = torch.where(ok, kept - kept.sum(dim=1, keepdim=True) / count.clamp(min=1), 0.0)
    if norm_by_std:
        var = (advantages**2).sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)  # (P, 1)
        advantages = advantages / (var.sqrt() + eps)  # (P, G)
    return advantages.reshape(-1)  # (B,)


def rloo_advantages(scores: Tensor, group_size: int, valid: Tensor | None = None) -> Tensor:
    """REINFORCE leave-one-out (Ahmadian et al. 2024): each score minus the mean of the other
    responses to the same prompt, a baseline that does not depend on the response itself.
    valid (B,) bool: the others are the valid ones alone; a valid row with none gets 0, an
    invalid row 0."""
    grouped = _groups(scores, group_size)  # (P, G)
    if valid is None:
        baseline = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)  # (P, G)
        return (grouped - baseline).reshape(-1)  # (B,)
    ok = valid.reshape(-1, group_size)  # (P, G)
    kept = torch.where(ok, grouped, 0.0)  # (P, G) NaN-free
    others = ok.sum(dim=1, keepdim=True) - 1  # (P, 1)
    baseline = (kept.sum(dim=1, keepdim=True) - kept) / others.clamp(min=1)  # (P, G)
    return torch.where(ok & (others > 0), kept - baseline, 0.0).reshape(-1)  # (B,)


def impute_invalid(scores: Tensor, valid: Tensor, group_size: int) -> Tensor:
    """Scores with each invalid row's replaced by the mean of its group's valid rows (0 in
    a group with none): the group's mean, and so every valid row's baseline, stays what the
    valid rows alone give. (B,), (B,) bool -> (B,)."""
    grouped = scores.reshape(-1, group_size)  # (P, G)
    ok = valid.reshape(-1, group_size)  # (P, G)
    count = ok.sum(dim=1, keepdim=True)  # (P, 1)
    mean = torch.where(ok, grouped, 0.0).sum(dim=1, keepdim=True) / count.clamp(min=1)
    return torch.where(ok, grouped, mean).reshape(-1)  # (B,)


def broadcast_to_tokens(seq_values: Tensor, mask: Tensor) -> Tensor:
    """Give every valid token its sequence's value: (B,) x mask (B, T) -> (B, T)."""
    return torch.where(mask.bool(), seq_values.unsqueeze(-1), 0.0)  # (B, T)


class AdvantageEstimator(Protocol):
    """Common signature of ADVANTAGE_ESTIMATORS entries; each ignores what it does not need.

    token_rewards, mask, values: (B, T). Returns (advantages, returns), each (B, T).
    row_valid (B,) bool, None for all: rows that are not (a failed episode) train nothing
    and must not move the others' baseline.
    """

    def __call__(
        self,
        token_rewards: Tensor,
        mask: Tensor,
        *,
        values: Tensor | None = None,
        group_size: int = 1,
        gamma: float = 1.0,
        gae_lambda: float = 1.0,
        row_valid: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]: ...


def _gae_estimator(
    token_rewards: Tensor,
    mask: Tensor,
    *,
    values: Tensor | None = None,
    group_size: int = 1,
    gamma: float = 1.0,
    gae_lambda: float = 1.0,
    row_valid: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    del group_size, row_valid  # the critic is the baseline; an invalid row has no mask
    if values is None:
        raise ValueError("the 'gae' advantage estimator needs critic values (values=...)")
    return compute_gae(token_rewards, values, mask, gamma, gae_lambda)


def _outcome_estimator(seq_advantages: Callable[..., Tensor]) -> AdvantageEstimator:
    def estimate(
        token_rewards: Tensor,
        mask: Tensor,
        *,
        values: Tensor | None = None,
        group_size: int = 1,
        gamma: float = 1.0,
        gae_lambda: float = 1.0,
        row_valid: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        del values, gamma, gae_lambda  # one score per response: no critic, no discounting
        scores = masked_sum(token_rewards.detach(), mask, dim=-1)  # (B,)
        if row_valid is None or bool(row_valid.all()):
            per_row = seq_advantages(scores, group_size)  # (B,)
        else:  # the group's baseline is its valid members'
            per_row = seq_advantages(scores, group_size, valid=row_valid)  # (B,)
        advantages = broadcast_to_tokens(per_row, mask)  # (B, T)
        return advantages, advantages  # without a critic the returns are never regressed on

    return estimate


def reinforce_pp_advantages(
    token_rewards: Tensor,
    mask: Tensor,
    *,
    baseline: str,
    group_size: int = 1,
    gamma: float = 1.0,
    row_valid: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025, "REINFORCE++: Stabilizing Critic-Free Policy Optimization with
    Global Advantage Normalization"): the discounted return of every token, normalised over
    the whole batch's tokens (mean shifted, unit variance) instead of per group.

    token_rewards, mask: (B, T). baseline "batch": the returns G_t themselves (REINFORCE++,
    the batch mean is the baseline); "group": G_t minus the mean score (token-reward sum) of
    the responses to the same prompt, before the batch normalisation (REINFORCE++-baseline,
    which keeps a group's spread out of the others'). Returns (advantages, returns G_t), each
    (B, T), zero on padding. A batch whose advantages do not vary gets zeros. row_valid (B,)
    bool: invalid rows (no mask) neither count in the statistics nor move a group's mean.
    """
    rewards = token_rewards.detach()
    # GAE with V = 0 and lambda = 1 is the discounted return: delta_t = r_t, A_t = r_t + g A_t+1
    returns, _ = compute_gae(rewards, torch.zeros_like(rewards), mask, gamma, 1.0)  # (B, T)
    if baseline == "group":
        scores = masked_sum(rewards, mask, dim=-1)  # (B,)
        if row_valid is not None:
            scores = impute_invalid(scores, row_valid, group_size)
        group_mean = _groups(scores, group_size).mean(dim=1, keepdim=True)  # (P, 1)
        per_row = group_mean.expand(-1, group_size).reshape(-1)  # (B,)
        advantages = returns - per_row.unsqueeze(-1)  # (B, T)
    elif baseline == "batch":
        advantages = returns
    else:
        raise ValueError(
            f"unknown REINFORCE++ baseline {baseline!r}; valid names: 'batch', 'group'"
        )
    valid = mask.bool()
    if row_valid is not None:
        valid = valid & row_valid.unsqueeze(-1)  # (B, T)
    return masked_whiten(advantages, valid), torch.where(valid, returns, 0.0)


def _reinforce_pp_estimator(baseline: str) -> AdvantageEstimator:
    def estimate(
        token_rewards: Tensor,
        mask: Tensor,
        *,
        values: Tensor | None = None,
        group_size: int = 1,
        gamma: float = 1.0,
        gae_lambda: float = 1.0,
        row_valid: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        del values, gae_lambda  # no critic: the return itself, normalised over the batch
        return reinforce_pp_advantages(
            token_rewards,
            mask,
            baseline=baseline,
            group_size=group_size,
            gamma=gamma,
            row_valid=row_valid,
        )

    return estimate


ADVANTAGE_ESTIMATORS: Mapping[str, AdvantageEstimator] = MappingProxyType(
    {
        "gae": _gae_estimator,
        "grpo": _outcome_estimator(grpo_advantages),
        "grpo-no-std": _outcome_estimator(functools.partial(grpo_advantages, norm_by_std=False)),
        "rloo": _outcome_estimator(rloo_advantages),
        "reinforce_pp": _reinforce_pp_estimator("batch"),
        "reinforce_pp-baseline": _reinforce_pp_estimator("group"),
    }
)


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    return lookup(ADVANTAGE_ESTIMATORS, name, "advantage estimator")
