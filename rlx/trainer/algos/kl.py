"""KL between the policy and the reference model, per token, from log-probs.

Per-token estimators of KL(pi || ref) from log-probs of tokens y sampled from the policy pi;
write r = ref(y) / pi(y). All are differentiable in logp: detach for a reward penalty, keep
the graph for a loss term. What each one is unbiased for (samples on-policy):
  k1 = -log r           value: unbiased for KL(pi || ref), high variance, negative on some
                        tokens. gradient: E[grad log pi] = 0, useless as a loss; a reward.
  k2 = (log r)^2 / 2    value: biased (close to KL only when pi ~ ref). gradient: exactly
                        grad KL(pi || ref) in expectation, the sound choice for a loss.
  k3 = r - 1 - log r    value: unbiased for KL(pi || ref), never negative, low variance.
                        gradient: E[(1 - r) grad log pi] = grad KL(ref || pi), the forward
                        KL; the loss GRPO uses.
"""

from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch
from torch import Tensor

from rlx.trainer.algos.common import MAX_LOG_RATIO, lookup


def kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    return logp - ref_logp  # (B, T)


def kl_k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    return 0.5 * (logp - ref_logp).square()  # (B, T)


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    # Clamped so that exp cannot overflow on tokens where the two models disagree wildly.
    log_r = (ref_logp - logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)  # (B, T)
    return log_r.exp() - 1 - log_r  # (B, T)


KL_ESTIMATORS: Mapping[str, Callable[[Tensor, Tensor], Tensor]] = MappingProxyType(
    {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}
)


def get_kl_estimator(name: str) -> Callable[[Tensor, Tensor], Tensor]:
    return lookup(KL_ESTIMATORS, name, "KL estimator")


def kl_penalized_rewards(
    token_rewards: Tensor,
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    *,
    kl_coef: float,
    estimator: str = "k1",
) -> tuple[Tensor, Tensor]:
    """Subtract kl_coef * KL from each token's reward (the InstructGPT-style penalty).

    All inputs (B, T). Returns (penalised rewards, per-token KL), each (B, T), KL zero on
    padding and detached: the penalty is part of the reward, not of the graph.
    """
    kl = get_kl_estimator(estimator)(logp.detach(), ref_logp.detach())  # (B, T)
    kl = torch.where(mask.bool(), kl, 0.0)  # (B, T)
    return token_rewards - kl_coef * kl, kl
