"""Reward terms: the two aggregate modes, NaN for a failure (never 0), a failed sample out
of its group's baseline, the terms' metrics, and the schema's and lint's one-line refusals."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import yaml

from rlx.errors import RecipeError, RlxError
from rlx.lint import lint_loaded
from rlx.recipe import load_recipe, parse_recipe
from rlx.recipe.model import RewardTerm, TrainerSettings
from rlx.trainer.algos.advantages import ADVANTAGE_ESTIMATORS
from rlx.trainer.tasks.reward_terms import (
    RewardTerms,
    Term,
    build_terms,
    combine,
    function_scorer,
    normalize_in_groups,
    term_metrics,
)

NAN = math.nan
TRAINER = {"model": {"path": "Qwen/Qwen2.5-0.5B"}, "data": {"train": "data.jsonl"}}


def _values(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


# ------------------------------------------------------------------------------ combine


def test_sum_then_normalize_adds_the_weighted_terms_and_a_weighted_nan_fails_the_sample():
    values = _values([1.0, 0.0, NAN, 1.0], [2.0, 4.0, 6.0, NAN])
    outcome, trained, valid = combine(values, [1.0, 0.5], "sum_then_normalize", 2)
    assert valid.tolist() == [True, True, False, False]
    assert outcome[:2].tolist() == [2.0, 2.0]  # 1 + 0.5 * 2, 0 + 0.5 * 4
    assert outcome[2:].isnan().all()  # no reward, never 0
    assert trained.tolist() == [2.0, 2.0, 0.0, 0.0]  # what trains nothing reads 0


def test_a_weight_zero_term_is_a_monitor_its_failure_fails_nothing():
    values = _values([1.0, 0.0], [NAN, 3.0])
    outcome, _, valid = combine(values, [1.0, 0.0], "sum_then_normalize", 1)
    assert valid.tolist() == [True, True]
    assert outcome.tolist() == [1.0, 0.0]


def test_normalize_then_sum_normalises_each_term_in_its_group_over_the_valid_members():
    # group 1: term a (1, 3, NaN), term b (10, 30, 20); the NaN row is out of both groups.
    # group 2: term a (0, 0, 6), term b (100, 100, 400).
    values = _values([1.0, 3.0, NAN, 0.0, 0.0, 6.0], [10.0, 30.0, 20.0, 100.0, 100.0, 400.0])
    outcome, trained, valid = combine(values, [1.0, 2.0], "normalize_then_sum", 3)
    assert valid.tolist() == [True, True, False, True, True, True]
    # group 1, a: mean 2, std sqrt(2) -> -/+ 1/sqrt(2); b: mean 20, std sqrt(200) -> same
    half = 1 / math.sqrt(2)
    # group 2, a: mean 2, deviations (-2, -2, 4), std sqrt(24 / 2) = sqrt(12); b alike x 50
    third = 2 / math.sqrt(12)
    want = [-3 * half, 3 * half, 0.0, -3 * third, -3 * third, 6 * third]
    assert trained.tolist() == pytest.approx(want, abs=1e-5)
    # the outcome stays the raw weighted sum (reward/mean reports it)
    assert outcome[0].item() == 21.0 and outcome[5].item() == 806.0
    assert outcome[2].isnan()


def test_normalize_then_sum_with_one_response_per_prompt_normalises_over_the_batch():
    values = _values([0.0, 2.0, 4.0])
    _, trained, _ = combine(values, [1.0], "normalize_then_sum", 1)
    assert trained.tolist() == pytest.approx([-1.0, 0.0, 1.0], abs=1e-5)


def test_a_group_with_one_valid_member_normalises_it_to_zero():
    values = torch.tensor([5.0, 1.0, 2.0], dtype=torch.float64)
    valid = torch.tensor([True, False, False])
    assert normalize_in_groups(values, valid, 3).tolist() == [0.0, 0.0, 0.0]


# ------------------------------------------------------------------ NaN out of baselines


def _token_rewards(scores: list[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One-token responses; a failed sample's reward reads 0 and its mask is off, as the
    trainer leaves them."""
    valid = torch.tensor([not math.isnan(s) for s in scores])
    rewards = torch.tensor([[0.0 if math.isnan(s) else s] for s in scores], dtype=torch.float64)
    mask = valid.unsqueeze(1)
    return rewards, mask, valid


def test_grpo_group_baseline_ignores_the_failed_member():
    rewards, mask, valid = _token_rewards([1.0, NAN, 0.0, 2.0, 0.0, 1.0, 1.0, 2.0])
    advantages, _ = ADVANTAGE_ESTIMATORS["grpo"](rewards, mask, group_size=4, row_valid=valid)
    # group 1 over (1, 0, 2): mean 1, unbiased std 1; group 2 over (0, 1, 1, 2): mean 1,
    # std sqrt(2 / 3)
    eps = 1e-6
    std = math.sqrt(2 / 3)
    want = [0.0, 0.0, -1 / (1 + eps), 1 / (1 + eps), -1 / (std + eps), 0.0, 0.0, 1 / (std + eps)]
    assert advantages.squeeze(1).tolist() == pytest.approx(want, abs=1e-9)


def test_grpo_without_std_and_rloo_leave_the_failed_member_out():
    rewards, mask, valid = _token_rewards([1.0, NAN, 0.0, 2.0])
    plain, _ = ADVANTAGE_ESTIMATORS["grpo-no-std"](rewards, mask, group_size=4, row_valid=valid)
    assert plain.squeeze(1).tolist() == [0.0, 0.0, -1.0, 1.0]
    rloo, _ = ADVANTAGE_ESTIMATORS["rloo"](rewards, mask, group_size=4, row_valid=valid)
    # each valid member minus the mean of the other valid ones: 1 - 1, 0 - 1.5, 2 - 0.5
    assert rloo.squeeze(1).tolist() == [0.0, 0.0, -1.5, 1.5]


def test_every_member_valid_gives_what_no_validity_gives():
    rewards, mask, valid = _token_rewards([1.0, 0.0, 0.0, 2.0])
    for name in ("grpo", "rloo"):
        with_valid, _ = ADVANTAGE_ESTIMATORS[name](rewards, mask, group_size=4, row_valid=valid)
        plain, _ = ADVANTAGE_ESTIMATORS[name](rewards, mask, group_size=4)
        assert torch.equal(with_valid, plain)


# ------------------------------------------------------------------- scoring and metrics


def _raises_on_b(prompt: str, response: str, answer: str | None) -> Any:
    if response == "b":
        raise KeyError("no b")
    return {"a": 1.0, "c": None, "d": float("inf")}.get(response, 0.5)


def test_a_function_term_gives_nan_where_it_raises_or_gives_no_finite_number():
    values, first = function_scorer(_raises_on_b)(["p"] * 5, ["a", "b", "c", "d", "e"], [None] * 5)
    assert values[0] == 1.0 and values[4] == 0.5
    assert all(math.isnan(v) for v in values[1:4])
    assert first == "sample 1: KeyError: 'no b'"


def test_metrics_per_term_count_failures_and_mean_over_finite_values():
    terms = RewardTerms(
        [
            Term("exact", 1.0, function_scorer(_raises_on_b), "function test"),
            Term("length", 0.0, function_scorer(lambda p, r, a: float(len(r))), "function len"),
        ]
    )
    scored = terms.score(["p"] * 4, ["a", "b", "e", "c"])
    metrics = scored.metrics()
    assert metrics["reward/exact/mean"] == 0.75  # (1 + 0.5) / 2
    assert metrics["reward/exact/failed"] == 2.0
    assert metrics["reward/length/mean"] == 1.0
    assert metrics["reward/length/failed"] == 0.0
    assert metrics["reward/failed"] == 0.5
    assert "exact (function test) failed on 2: sample 1: KeyError" in scored.failure_line()
    both = term_metrics([scored, scored])
    assert both["reward/exact/failed"] == 4.0 and both["reward/failed"] == 0.5


def test_a_term_that_gives_the_wrong_count_is_one_line():
    terms = RewardTerms([Term("short", 1.0, lambda p, r, a, extra=None: ([1.0], None), "url x")])
    with pytest.raises(RlxError, match="gave 1 values for 2 samples"):
        terms.score(["p", "q"], ["a", "b"])


# --------------------------------------------------------------------------- the recipe


def _trainer(**fields: Any) -> TrainerSettings:
    return TrainerSettings.model_validate({**TRAINER, **fields})


def test_the_single_reward_is_one_term_of_weight_one():
    [term] = _trainer(reward={"function": "gsm8k", "gsm8k_mode": "flexible"}).reward_terms()
    assert (term.function, term.weight, term.label) == ("gsm8k_flexible", 1.0, "gsm8k_flexible")
    assert _trainer().reward_term_fields() == [("trainer", "reward")]


def test_term_names_derive_from_the_function_or_the_host():
    assert RewardTerm(function="pkg.mod:exact").label == "exact"
    assert RewardTerm(function="rewards.py:fn").label == "fn"
    assert RewardTerm(url="https://user@judge.example.com:8443/score").label == "judge.example.com"
    assert RewardTerm(url="http://x/y", name="verifier").label == "verifier"


def test_a_recipe_with_terms_reads_back_from_its_dump():
    rewards = [{"function": "letters_or_digits"}, {"url": "http://127.0.0.1:9/s", "weight": 0}]
    settings = _trainer(rewards=rewards, reward_aggregate="normalize_then_sum")
    again = TrainerSettings.model_validate(settings.model_dump())
    assert again == settings
    assert "reward" not in settings.model_dump()
    assert "rewards" not in _trainer().model_dump()


def _errors(trainer: dict[str, Any]) -> dict[str, str]:
    data = {"name": "job", "trainer": {**TRAINER, **trainer}}
    with pytest.raises(RecipeError) as refusal:
        parse_recipe(yaml.safe_dump(data))
    return {f.field: f.message for f in refusal.value.findings}


SCHEMA_CASES = [
    (
        {"reward": {"function": "gsm8k"}, "rewards": [{"function": "gsm8k"}]},
        "trainer",
        "both reward: and rewards: are set; keep one",
    ),
    (
        {"rewards": [{"function": "gsm8k", "weight": 0}, {"url": "http://h/s", "weight": 0}]},
        "trainer",
        "every term of rewards: has weight 0, so nothing trains",
    ),
    ({"rewards": [{"url": "ftp://h/s"}]}, "trainer.rewards[0]", "is not an http:// or https://"),
    ({"rewards": [{"url": "h:8000/s"}]}, "trainer.rewards[0]", "is not an http:// or https://"),
    ({"rewards": [{"weight": 1}]}, "trainer.rewards[0]", "none of function:, model: and url:"),
    (
        {"rewards": [{"function": "gsm8k", "url": "http://h/s"}]},
        "trainer.rewards[0]",
        "sets function: and url:",
    ),
    (
        {"rewards": [{"function": "gsm8k", "timeout_s": 3, "retries": 1}]},
        "trainer.rewards[0]",
        "timeout_s, retries are for url: terms",
    ),
    (
        {"rewards": [{"function": "a.py:fn"}, {"function": "b.py:fn"}]},
        "trainer",
        "2 terms are named 'fn'; give each a name:",
    ),
    ({"rewards": [{"function": "gsm8k", "name": "a b"}]}, "trainer.rewards[0]", "not a metric"),
    ({"reward_max_failed": 1.5}, "trainer.reward_max_failed", ""),
]


@pytest.mark.parametrize("trainer,field,words", SCHEMA_CASES)
def test_bad_terms_are_one_line(trainer: dict[str, Any], field: str, words: str):
    errors = _errors(trainer)
    assert field in errors, errors
    assert words in errors[field]
    assert "\n" not in errors[field]


def _lint(tmp_path: Any, trainer: dict[str, Any], secrets: list[str]) -> list[str]:
    data = {
        "name": "job",
        "secrets": secrets,
        "trainer": {"model": {"path": "tiny:qwen2-h64-l2"}, "data": {"train": "synthetic:x"}},
    }
    data["trainer"].update(trainer)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return [
        f"{f.field}: {f.message}"
        for f in lint_loaded(load_recipe(path))
        if f.severity == "error" and "rewards" in f.field
    ]


def test_lint_refuses_a_secret_not_in_secrets_and_a_function_that_names_nothing(tmp_path):
    rewards = [
        {"url": "https://judge.example.com/score", "auth_secret": "JUDGE_KEY"},
        {"function": "gsm9k", "weight": 0},
    ]
    said = _lint(tmp_path, {"rewards": rewards}, ["HF_TOKEN"])
    assert said[0] == (
        "trainer.rewards[0].auth_secret: JUDGE_KEY is not in the recipe's secrets: (listed: "
        "HF_TOKEN); add it there (secrets: [JUDGE_KEY]) so its value reaches the nodes from "
        "your environment"
    )
    assert said[1].startswith("trainer.rewards[1].function: ")
    assert "gsm9k" in said[1]
    assert _lint(tmp_path, {"rewards": rewards[:1]}, ["JUDGE_KEY"]) == []


def test_the_servers_secret_is_read_from_the_environment_and_never_said():
    settings = _trainer(rewards=[{"url": "http://127.0.0.1:9/s", "auth_secret": "JUDGE_KEY"}])
    terms = build_terms(settings, {"JUDGE_KEY": "s3cr3t-value"})
    [term] = terms.terms
    assert term.source == "url http://127.0.0.1:9/s"
    with pytest.raises(RlxError) as refusal:
        build_terms(settings, {})
    said = str(refusal.value)
    assert "JUDGE_KEY, which is not set in the environment" in said and "\n" not in said


# ----------------------------------------------------------------------------- the step


def _length(prompt: str, response: str, answer: str | None) -> float:
    return float(len(response))


class _Tokenizer:
    def batch_decode(self, ids: list[list[int]], skip_special_tokens: bool) -> list[str]:
        return ["".join(chr(i) for i in row) for row in ids]


def _trainer_scoring(rewards: list[dict[str, Any]], **fields: Any) -> Any:
    """A Trainer with just what scoring reads: settings, prompts, the terms."""
    from types import SimpleNamespace

    from rlx.trainer.loop import Trainer

    settings = _trainer(rewards=rewards, rollout={"n": 2}, **fields)
    trainer = Trainer.__new__(Trainer)
    trainer.settings = settings
    trainer.clock = None
    trainer.term_scores = []
    data = SimpleNamespace(
        prompts=["p0", "p1"], answers=[None, None], prompt_token_ids=[[1], [2]], messages=[]
    )
    trainer.inputs = SimpleNamespace(
        tokenizer=_Tokenizer(), data=data, rewards=build_terms(settings, {})
    )
    return trainer


def _rollout(responses: list[str]) -> tuple[Any, Any]:
    from types import SimpleNamespace

    ids = [[ord(c) for c in text] for text in responses]
    rollout = SimpleNamespace(episodes=None, response_lists=lambda: ids)
    mask = torch.ones(len(ids), 3, dtype=torch.bool)
    return rollout, SimpleNamespace(response_mask=mask)


def test_a_step_leaves_failed_samples_untrained_and_counted():
    trainer = _trainer_scoring(
        [
            {"function": f"{__name__}:_raises_on_b", "name": "exact"},
            {"function": f"{__name__}:_length", "weight": 0},
        ]
    )
    rollout, batch = _rollout(["a", "b", "e", "a"])
    scored = trainer._rewards(1, [0, 1], rollout, batch)
    assert scored.trains.tolist() == [True, False, True, True]
    assert scored.scores[1].isnan() and scored.scores[0].item() == 1.0
    assert scored.token_rewards[1].abs().sum().item() == 0.0  # nothing for a failed sample
    assert scored.token_rewards[0, -1].item() == 1.0  # the outcome on the last token
    metrics = term_metrics(trainer.term_scores)
    assert metrics["reward/exact/failed"] == 1.0 and metrics["reward/failed"] == 0.25
    assert metrics["reward/_length/failed"] == 0.0 and metrics["reward/_length/mean"] == 1.0


def test_too_many_failed_samples_stop_the_step_before_its_update_in_one_line():
    trainer = _trainer_scoring(
        [{"function": f"{__name__}:_raises_on_b", "name": "exact"}], reward_max_failed=0.25
    )
    rollout, batch = _rollout(["b", "b", "a", "a"])
    with pytest.raises(RlxError) as stop:
        trainer._rewards(3, [0, 1], rollout, batch)
    said = str(stop.value)
    assert said.startswith(
        "step 3: 2 of 4 samples (50%) have no reward, more than trainer.reward_max_failed "
        "0.25: exact (function "
    )
    assert "failed on 2: sample 0: KeyError: 'no b'" in said
    assert "the last checkpoint is kept" in said and "\n" not in said


def _hangs_on_c(prompt: str, response: str, answer: str | None) -> float:
    if response == "c":
        import time

        time.sleep(10)
    return 1.0


def test_a_hung_function_term_is_named_by_its_sample():
    from rlx.trainer.stall import StallClock, Stalled

    trainer = _trainer_scoring([{"function": f"{__name__}:_hangs_on_c"}])
    trainer.clock = StallClock(0.5)
    with pytest.raises(Stalled) as stall:
        trainer.score_terms(["p"] * 4, ["a", "c", "a", "a"], [None] * 4)
    said = str(stall.value)
    assert f"did not answer: reward function {__name__}:_hangs_on_c (sample 1 of 4)" in said
