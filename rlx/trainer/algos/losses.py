"""Per-token losses (policy: PPO, GSPO, CISPO; value) and the log-prob / entropy maths."""

from collections.abc import Mapping
from types import MappingProxyType
from typing import Protocol

import torch
from torch import Tensor

from rlx.trainer.algos.common import MAX_LOG_RATIO, Metrics, lookup
from rlx.trainer.algos.correction import rollout_correction_weights
from rlx.trainer.algos.masked import masked_mean


def _clip_bounds(clip_eps_low: float, clip_eps_high: float | None) -> tuple[float, float]:
    high = clip_eps_low if clip_eps_high is None else clip_eps_high
    return 1.0 - clip_eps_low, 1.0 + high


def _pessimistic_surrogate(
    ratio: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps_low: float,
    clip_eps_high: float | None,
    dual_clip_c: float | None,
) -> tuple[Tensor, Metrics]:
    """max(-A r, -A clip(r)), then the dual clip: PPO's per-token loss in any ratio r (B, T)."""
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be greater than 1, got {dual_clip_c}")
    low, high = _clip_bounds(clip_eps_low, clip_eps_high)
    unclipped = -advantages * ratio  # (B, T)
    clipped = -advantages * ratio.clamp(low, high)  # (B, T)
    loss = torch.maximum(unclipped, clipped)  # (B, T) pessimistic bound
    with torch.no_grad():
        metrics: Metrics = {"clipfrac": masked_mean((clipped > unclipped).float(), mask)}
    if dual_clip_c is not None:
        cap = -dual_clip_c * advantages  # (B, T)
        dual_clipped = (advantages < 0) & (loss > cap)  # (B, T)
        loss = torch.where(dual_clipped, cap, loss)  # (B, T)
        metrics["dual_clipfrac"] = masked_mean(dual_clipped.float(), mask)
    return loss, metrics


def _finish(loss: Tensor, mask: Tensor, behavior_weight: Tensor | None) -> Tensor:
    if behavior_weight is not None:
        loss = behavior_weight * loss  # (B, T)
    return torch.where(mask.bool(), loss, 0.0)


def _drift_metrics(logratio: Tensor, ratio: Tensor, mask: Tensor) -> Metrics:
    with torch.no_grad():
        token_ratio = logratio.exp()  # (B, T)
        return {
            "approx_kl": masked_mean((token_ratio - 1) - logratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
        }


def ppo_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip_c: float | None = None,
    behavior_weight: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """PPO clipped surrogate (Schulman et al. 2017), per token, to be minimised.

    logp, old_logp, advantages, mask: (B, T). The ratio is clipped to
    [1 - clip_eps_low, 1 + clip_eps_high] (clip_eps_high defaults to clip_eps_low; a larger one
    is DAPO's clip-higher). dual_clip_c > 1 also caps the loss of negative-advantage tokens at
    -c * A (Ye et al. 2020), which the plain max leaves unbounded as the ratio grows.
    behavior_weight (B, T), detached: with samples from an older policy than old_logp's
    (decoupled PPO, see behavior_weights) each token's clipped objective is weighted by it.
    Returns the loss (B, T), zero on padding, and detached masked metrics: clipfrac (share of
    tokens whose gradient the clip removed), approx_kl (mean of (ratio - 1) - logratio, the k3
    estimate of KL(old || new)), ratio_mean, and dual_clipfrac when dual clipping is on.
    """
    # The two log-probs come from different kernels (rollout engine, trainer) and can disagree
    # wildly on rare tokens; exp would overflow to inf and 0 * inf is NaN in the backward pass.
    # A token past the clamp gets no gradient: at that distance it is noise, not signal.
    logratio = (logp - old_logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)  # (B, T)
    ratio = logratio.exp()  # (B, T)
    loss, metrics = _pessimistic_surrogate(
        ratio, advantages, mask, clip_eps_low, clip_eps_high, dual_clip_c
    )
    metrics = {**_drift_metrics(logratio.detach(), ratio.detach(), mask), **metrics}
    return _finish(loss, mask, behavior_weight), metrics


def gspo_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip_c: float | None = None,
    behavior_weight: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"), per token, minimised.

    The ratio is the response's, normalised by its length: s_i = exp(mean_t log(pi / pi_old)),
    clipped per sequence (every token of a response has the same s_i, so the clip keeps or
    drops the whole response). Written per token as the paper's GSPO-token,
    s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)]: its value is s_i and its gradient s_i grad log
    pi(y_t), so with per-sequence advantages the seq-mean-token-mean aggregation gives GSPO's
    gradient s_i A_i grad log s_i exactly (a token-mean would weigh long responses more, which
    GSPO's normalisation removes). The paper's clip range is about 1e-4 wide (3e-4 below, 4e-4
    above), PPO's 0.2 almost never clips a sequence ratio. Arguments, dual clip and behaviour
    weight as ppo_policy_loss; metrics too, with ratio_mean the mean sequence ratio (per token)
    and clipfrac the share of tokens in clipped responses.
    """
    valid = mask.bool()  # (B, T)
    logratio = torch.where(valid, logp - old_logp, 0.0).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    seq_logratio = masked_mean(logratio, valid, dim=-1).unsqueeze(-1)  # (B, 1) log s_i
    own = torch.where(valid, logp - logp.detach(), 0.0)  # (B, T) value 0, gradient grad log pi
    ratio = (seq_logratio.detach() + own).exp()  # (B, T) s_i,t
    loss, metrics = _pessimistic_surrogate(
        ratio, advantages, mask, clip_eps_low, clip_eps_high, dual_clip_c
    )
    metrics = {**_drift_metrics(logratio.detach(), ratio.detach(), mask), **metrics}
    return _finish(loss, mask, behavior_weight), metrics


def cispo_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip_c: float | None = None,
    behavior_weight: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """CISPO (MiniMax 2025, "MiniMax-M1"), per token, to be minimised: -sg(clip(r)) A log pi.

    The importance weight r = pi / pi_old is clipped to [1 - clip_eps_low, 1 + clip_eps_high]
    and its gradient stopped, so every token keeps a gradient (PPO's clip drops the gradient
    of a token past the range; CISPO only bounds its weight). The paper bounds the weight
    above only (a large clip_eps_low). The loss's value is A-weighted log-likelihood, not a
    surrogate near 0: compare its gradient with PPO's, not its value. No dual clip (the loss
    is linear in log pi; there is no unbounded ratio to cap). Metrics as ppo_policy_loss, with
    clipfrac the share of tokens whose weight was clipped.
    """
    if dual_clip_c is not None:
        raise ValueError(
            "cispo has no dual clip: its weight is already clipped and its gradient stopped; "
            "leave dual_clip_c unset"
        )
    low, high = _clip_bounds(clip_eps_low, clip_eps_high)
    logratio = (logp - old_logp).detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)  # (B, T)
    ratio = logratio.exp()  # (B, T), no gradient
    # sg(clip(r)), 0 on padding: a NaN there would reach log pi's gradient as NaN x 0
    weight = torch.where(mask.bool(), ratio.clamp(low, high), 0.0)  # (B, T)
    loss = -advantages * weight * logp  # (B, T)
    metrics = _drift_metrics(logratio, ratio, mask)
    metrics["clipfrac"] = masked_mean(((ratio < low) | (ratio > high)).float(), mask)
    return _finish(loss, mask, behavior_weight), metrics


class PolicyLoss(Protocol):
    """Common signature of POLICY_LOSSES entries: (B, T) inputs -> (loss (B, T), metrics)."""

    def __call__(
        self,
        logp: Tensor,
        old_logp: Tensor,
        advantages: Tensor,
        mask: Tensor,
        *,
        clip_eps_low: float = 0.2,
        clip_eps_high: float | None = None,
        dual_clip_c: float | None = None,
        behavior_weight: Tensor | None = None,
    ) -> tuple[Tensor, Metrics]: ...


POLICY_LOSSES: Mapping[str, PolicyLoss] = MappingProxyType(
    {"ppo": ppo_policy_loss, "gspo": gspo_policy_loss, "cispo": cispo_policy_loss}
)


def get_policy_loss(name: str) -> PolicyLoss:
    return lookup(POLICY_LOSSES, name, "policy loss")


def behavior_weights(
    proximal_logp: Tensor, behavior_logp: Tensor, mask: Tensor, *, cap: float
) -> tuple[Tensor, Metrics]:
    """Importance weights of decoupled PPO for samples the engines made with older weights.

    Decoupled PPO (Hilton, Cobbe and Schulman 2022, "Batch size-invariance for policy
    optimization"; the objective AReaL trains asynchronously with, Fu et al. 2025) separates
    the policy that sampled a token (behaviour: the engine's log-prob, returned with the
    sample) from the one the update is clipped around (proximal: the learner's log-prob
    before this step's update). The clipped objective in ratio pi / pi_proximal is weighted
    by pi_proximal / pi_behaviour, which corrects for the samples being up to k versions old
    and for the engine's numerics. The weight is truncated at `cap` (truncated importance
    sampling, Espeholt et al. 2018, IMPALA): a token the engine found far less likely than
    the learner does counts at most `cap` times, bounding the update's variance. It is
    correction.rollout_correction_weights at the token level, truncated at `cap`; the
    metrics keep their offpolicy/ names.

    proximal_logp, behavior_logp, mask: (B, T). Returns the weights (B, T), detached, 0 on
    padding, and metrics: the raw weight's mean and mean square (its spread: std =
    sqrt(sq_mean - mean^2)) and the share of tokens whose weight was truncated.
    """
    weight, metrics = rollout_correction_weights(
        proximal_logp, behavior_logp, mask, level="token", action="truncate", high=cap
    )
    renamed = {
        "offpolicy/weight_mean": "mismatch/weight_mean",
        "offpolicy/weight_sq_mean": "mismatch/weight_sq_mean",
        "offpolicy/truncated_frac": "mismatch/truncated_fraction",
    }
    return weight, {name: metrics[source] for name, source in renamed.items()}


def clipped_value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    clip_eps: float | None = 0.2,
) -> tuple[Tensor, Metrics]:
    """PPO value loss 0.5 * max((v - R)^2, (v_clip - R)^2), v_clip = old_v + clamp(v - old_v).

    All inputs (B, T). clip_eps is in reward units, not relative; None turns clipping off.
    Returns the loss (B, T), zero on padding, and metrics: vf_clipfrac (share of tokens whose
    gradient the clip removed).
    """
    unclipped = (values - returns).square()  # (B, T)
    if clip_eps is None:
        loss = 0.5 * unclipped  # (B, T)
        clipfrac = values.new_zeros(())
    else:
        values_clipped = old_values + (values - old_values).clamp(-clip_eps, clip_eps)  # (B, T)
        clipped = (values_clipped - returns).square()  # (B, T)
        loss = 0.5 * torch.maximum(unclipped, clipped)  # (B, T)
        clipfrac = masked_mean((clipped > unclipped).float().detach(), mask)
    return torch.where(mask.bool(), loss, 0.0), {"vf_clipfrac": clipfrac}


def logprobs_from_logits(logits: Tensor, tokens: Tensor) -> Tensor:
    """Log-probability of each chosen token: logits (B, T, V), tokens (B, T) -> (B, T), fp32.

    Computed as z[token] - logsumexp(z): unlike log_softmax, no second (B, T, V) tensor is kept
    for the backward pass. Half-precision logits are upcast first, because bf16 log-probs are
    off by ~1e-2, too coarse for exp(logp - old_logp).
    """
    logits = logits.float()  # (B, T, V) no copy when already fp32
    token_logits = logits.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)  # (B, T)
    return token_logits - torch.logsumexp(logits, dim=-1)  # (B, T)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the softmax of logits (..., V) -> (...), in fp32.

    H = logsumexp(z) - sum_v p_v z_v: both terms are overflow-free and only the probabilities
    are materialised (einsum contracts V without forming the (..., V) product).
    """
    logits = logits.float()  # (B, T, V)
    probs = torch.softmax(logits, dim=-1)  # (B, T, V)
    return torch.logsumexp(logits, dim=-1) - torch.einsum("...v,...v->...", probs, logits)
