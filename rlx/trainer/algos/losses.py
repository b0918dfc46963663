"""Per-token losses (PPO policy and value) and the log-prob / entropy maths under them."""

import torch
from torch import Tensor

from rlx.trainer.algos.common import MAX_LOG_RATIO, Metrics
from rlx.trainer.algos.correction import rollout_correction_weights
from rlx.trainer.algos.masked import masked_mean


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
    if clip_eps_high is None:
        clip_eps_high = clip_eps_low
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be greater than 1, got {dual_clip_c}")
    # The two log-probs come from different kernels (rollout engine, trainer) and can disagree
    # wildly on rare tokens; exp would overflow to inf and 0 * inf is NaN in the backward pass.
    # A token past the clamp gets no gradient: at that distance it is noise, not signal.
    logratio = (logp - old_logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)  # (B, T)
    ratio = logratio.exp()  # (B, T)
    unclipped = -advantages * ratio  # (B, T)
    clipped = -advantages * ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)  # (B, T)
    loss = torch.maximum(unclipped, clipped)  # (B, T) pessimistic bound
    with torch.no_grad():
        metrics: Metrics = {
            "clipfrac": masked_mean((clipped > unclipped).float(), mask),
            "approx_kl": masked_mean((ratio - 1) - logratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    if dual_clip_c is not None:
        cap = -dual_clip_c * advantages  # (B, T)
        dual_clipped = (advantages < 0) & (loss > cap)  # (B, T)
        loss = torch.where(dual_clipped, cap, loss)  # (B, T)
        metrics["dual_clipfrac"] = masked_mean(dual_clipped.float(), mask)
    if behavior_weight is not None:
        loss = behavior_weight * loss  # (B, T)
    return torch.where(mask.bool(), loss, 0.0), metrics


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
