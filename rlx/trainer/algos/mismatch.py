"""How far the engine that sampled a batch and the learner that trains on it disagree.

Every sampled token y carries two log-probs of the same weights: the engine's (vLLM or the HF
engine, often bf16 with its own kernels), which drew it, and the learner's (its own forward,
another dtype or kernel). Where they agree to float32 resolution training is on-policy; where
they do not, the samples come from a slightly different policy than the one the loss assumes.
Write r = learner(y) / engine(y); tokens are drawn from the engine, so:
  kl                    mean over tokens of k3 = r - 1 - log r: unbiased for KL(engine ||
                        learner), never negative, log r clamped as kl.kl_k3 does;
  log_ppl_diff          per sequence, the learner's log-perplexity minus the engine's (the mean
                        of log engine - log learner over its tokens), averaged over sequences;
  max_abs_logprob_diff  the largest |log learner - log engine| of any token;
  max_abs_prob_diff     the largest |learner(y) - engine(y)| of any token (what papers plot).
With no valid token every figure is NaN: nothing was measured, which is not agreement.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlx.trainer.algos.kl import kl_k3
from rlx.trainer.algos.masked import masked_mean

MISMATCH_METRICS = ("kl", "log_ppl_diff", "max_abs_logprob_diff", "max_abs_prob_diff")


def mismatch_metrics(engine_logp: Tensor, learner_logp: Tensor, mask: Tensor) -> dict[str, float]:
    """The figures above, keyed `mismatch/<name>`. All inputs (B, T); padding ignored (it may
    hold anything, inf and NaN included)."""
    valid = mask.bool()  # (B, T)
    if not bool(valid.any()):
        return {f"mismatch/{name}": float("nan") for name in MISMATCH_METRICS}
    engine = torch.where(valid, engine_logp.detach().double(), 0.0)  # (B, T)
    learner = torch.where(valid, learner_logp.detach().double(), 0.0)  # (B, T)
    k3 = kl_k3(engine, learner)  # (B, T): r = learner / engine
    gap = engine - learner  # (B, T)
    rows = valid.any(dim=1)  # (B,): sequences with a token
    per_seq = masked_mean(gap, valid, dim=1)[rows]  # (B',)
    prob_gap = (learner.exp() - engine.exp()).abs()  # (B, T)
    return {
        "mismatch/kl": float(masked_mean(k3, valid)),
        "mismatch/log_ppl_diff": float(per_seq.mean()),
        "mismatch/max_abs_logprob_diff": float(gap.abs()[valid].max()),
        "mismatch/max_abs_prob_diff": float(prob_gap[valid].max()),
    }
