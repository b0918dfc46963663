"""What n samples per prompt say about a policy, as papers report it: pass@k (the unbiased
estimator of Chen et al. 2021), avg@n (the mean reward) and maj@n (the majority answer's
correctness). Pure Python: evaluation and validation both call it.

pass@k is the chance that at least one of k samples drawn without replacement from the n
is correct, 1 - C(n-c, k) / C(n, k) for c correct of n. Resampling k of the n WITH
replacement (a bootstrap) estimates 1 - (1 - c/n)^k instead, which is biased low: one
correct of four gives it 0.684 for pass@4, where every draw of 4 of the 4 holds the one.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k), as a product of k factors (no huge binomials): the share of
    the k-subsets of n samples, c of them correct, that hold at least one correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0  # every k-subset holds a correct sample
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def ks_up_to(n: int) -> list[int]:
    """The k of pass@k a table shows for n samples: 1, 2, 4, ... up to n."""
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    return ks


def majority_correct(answers: Sequence[str | None], correct: Sequence[bool]) -> bool:
    """Whether the most common answer among the samples is a correct one. Samples without
    an answer do not vote; a tie goes to the answer seen first; no answer at all: wrong."""
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return False
    most = max(votes.values())
    winner = next(a for a in answers if a is not None and votes[a] == most)
    return any(ok for a, ok in zip(answers, correct, strict=True) if a == winner)


@dataclass(frozen=True)
class PromptSamples:
    """One prompt's n samples: their rewards, whether each is correct (reward at or above
    the pass threshold), each one's extracted answer (None: none, or the reward compares no
    answers) and length in tokens."""

    rewards: Sequence[float]
    correct: Sequence[bool]
    answers: Sequence[str | None]
    lengths: Sequence[int]


def summarize(prompts: Sequence[PromptSamples], compares_answers: bool) -> dict[str, float]:
    """pass@k for k = 1, 2, 4, ... <= n, avg@n, maj@n (where answers compare) and the mean
    response length, each averaged over the prompts; every prompt has the same n. A sample
    whose reward failed (NaN) is not correct and is left out of avg@n (NaN: none scored)."""
    if not prompts:
        raise ValueError("summarize needs at least one prompt")
    n = len(prompts[0].rewards)
    if n < 1 or any(len(p.rewards) != n for p in prompts):
        raise ValueError("every prompt needs the same number (at least 1) of samples")
    out: dict[str, float] = {}
    for k in ks_up_to(n):
        estimates = [pass_at_k(n, sum(map(bool, p.correct)), k) for p in prompts]
        out[f"pass@{k}"] = sum(estimates) / len(prompts)
    scored = [r for p in prompts for r in p.rewards if math.isfinite(r)]
    out[f"avg@{n}"] = sum(scored) / len(scored) if scored else math.nan
    if compares_answers:
        votes = [majority_correct(p.answers, p.correct) for p in prompts]
        out[f"maj@{n}"] = sum(votes) / len(prompts)
    out["response_length"] = sum(sum(p.lengths) for p in prompts) / (n * len(prompts))
    return out
