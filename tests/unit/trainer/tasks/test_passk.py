"""pass@k, maj@n and avg@n as `rlx eval` and validation report them."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest

from rlx.trainer.tasks.passk import (
    PromptSamples,
    ks_up_to,
    majority_correct,
    pass_at_k,
    summarize,
)


def _by_subsets(correct: list[bool], k: int) -> float:
    """pass@k by brute force: the share of k-subsets of the samples holding a correct one."""
    subsets = list(itertools.combinations(correct, k))
    return sum(any(s) for s in subsets) / len(subsets)


def test_one_correct_of_four_gives_pass_at_4_of_one():
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(4, 0, 4) == 0.0


@pytest.mark.parametrize("n", [1, 2, 5, 8, 13])
def test_pass_at_k_is_the_share_of_k_subsets_with_a_correct_sample(n: int):
    for c in range(n + 1):
        correct = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(_by_subsets(correct, k), abs=1e-12)
            assert pass_at_k(n, c, k) == pytest.approx(
                1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12
            )


def test_pass_at_k_stays_finite_where_binomials_are_huge():
    value = pass_at_k(2000, 3, 1024)
    assert 0.0 < value <= 1.0 and math.isfinite(value)
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 2)


def test_a_bootstrap_is_biased_where_the_estimator_is_not():
    """Draw n samples at a true per-sample success p: the estimator's expectation over the
    binomial is the true pass@k, 1 - (1 - p)^k; resampling k of the n with replacement
    (1 - (1 - c/n)^k per draw) falls short of it, and gives 0.684 for one correct of four."""
    n, k = 4, 4

    def bootstrap(c: int) -> float:  # k draws with replacement from n, c of them correct
        return 1 - (1 - c / n) ** k

    assert bootstrap(1) == pytest.approx(0.684, abs=1e-3) and pass_at_k(n, 1, k) == 1.0
    for p in (0.1, 0.25, 0.5):
        truth = 1 - (1 - p) ** k
        weights = [math.comb(n, c) * p**c * (1 - p) ** (n - c) for c in range(n + 1)]
        unbiased = sum(w * pass_at_k(n, c, k) for c, w in enumerate(weights))
        biased = sum(w * bootstrap(c) for c, w in enumerate(weights))
        assert unbiased == pytest.approx(truth, abs=1e-12)
        assert biased < truth - 0.05


def test_ks_are_powers_of_two_up_to_n():
    assert ks_up_to(1) == [1]
    assert ks_up_to(4) == [1, 2, 4]
    assert ks_up_to(12) == [1, 2, 4, 8]


def test_the_majority_answer_decides():
    assert majority_correct(["7", "7", "3", None], [True, True, False, False])
    assert not majority_correct(["7", "3", "3"], [True, False, False])
    # a tie goes to the answer seen first; unanswered samples do not vote
    assert not majority_correct(["3", "7", None, None], [False, True, False, False])
    assert majority_correct([None, "7", "3", None], [False, True, False, False])
    assert not majority_correct([None, None], [False, False])


def test_summary_keys_and_values():
    prompts = [
        PromptSamples(
            [1.0, 0.0, 0.0, 0.0], [True, False, False, False], ["5", "4", "4", "3"], [3, 5, 2, 2]
        ),
        PromptSamples(
            [0.5, 1.0, 1.0, 0.0], [False, True, True, False], ["2", "1", "1", None], [1, 1, 1, 1]
        ),
    ]
    summary = summarize(prompts, compares_answers=True)
    assert list(summary) == ["pass@1", "pass@2", "pass@4", "avg@4", "maj@4", "response_length"]
    assert summary["pass@1"] == pytest.approx((0.25 + 0.5) / 2)
    assert summary["pass@4"] == 1.0
    assert summary["avg@4"] == pytest.approx(3.5 / 8)
    assert summary["maj@4"] == 0.5  # "4" wins the first (wrong), "1" the second (right)
    assert summary["response_length"] == pytest.approx(16 / 8)
    assert "maj@4" not in summarize(prompts, compares_answers=False)


def recompute_from_samples(path: Path) -> dict[str, float]:
    """pass@k and avg@n from a samples.jsonl alone, by counting subsets: independent of the
    estimator's product form (the eval test uses it on what `rlx eval --out` writes)."""
    groups: dict[int, list[dict]] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        groups.setdefault(row["index"], []).append(row)
    n = len(next(iter(groups.values())))
    out = {}
    k = 1
    while k <= n:
        shares = [_by_subsets([r["correct"] for r in rows], k) for rows in groups.values()]
        out[f"pass@{k}"] = sum(shares) / len(shares)
        k *= 2
    out[f"avg@{n}"] = sum(r["reward"] for rows in groups.values() for r in rows) / (n * len(groups))
    return out


def test_the_estimator_equals_a_count_from_a_samples_file(tmp_path: Path):
    import random

    rng = random.Random(0)
    rows, prompts = [], []
    for index in range(6):
        rewards = [float(rng.random() < 0.3) for _ in range(8)]
        prompts.append(PromptSamples(rewards, [r >= 1.0 for r in rewards], [None] * 8, [1] * 8))
        rows += [
            {"index": index, "sample": j, "reward": r, "correct": r >= 1.0}
            for j, r in enumerate(rewards)
        ]
    path = tmp_path / "samples.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = summarize(prompts, compares_answers=False)
    for name, value in recompute_from_samples(path).items():
        assert summary[name] == pytest.approx(value, abs=1e-12), name


def test_answers_read_as_the_rewards_read_them():
    from rlx.trainer.tasks.rewards import ANSWER_EXTRACTORS, REWARD_FUNCTIONS

    gsm8k = ANSWER_EXTRACTORS["gsm8k"]
    assert gsm8k("so #### 1,000.0") == gsm8k("#### 1000") == "1000"
    assert gsm8k("no marker 12") is None
    assert ANSWER_EXTRACTORS["gsm8k_flexible"]("a 3 then $4.50") == "4.5"
    # equal extracted answers score alike
    for response in ("#### 12", "#### 12.0", "#### 13"):
        same = gsm8k(response) == "12"
        assert REWARD_FUNCTIONS["gsm8k"]("", response, "12") == float(same)
    read = ANSWER_EXTRACTORS["math_verify"]
    assert read("so \\boxed{\\frac{1}{2}}") == read("the answer is $0.5$") == "1/2"
    assert "letters_or_digits" not in ANSWER_EXTRACTORS
