"""algo.rollout_correction's auto, decided once by TrainJob.of: on where the engines and the
learner can disagree, off (nothing sent, nothing computed) where they agree."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rlx.recipe.correction import correction_bounds
from rlx.trainer.job import engine_dtype_name, runs_ahead, with_correction_decided
from rlx.trainer.learn.learner import correction_on, sends_engine_logprobs
from tests.support.recipes import small_trainer

CASES: list[tuple[str, dict[str, Any], str, bool, bool]] = [
    # (case, overrides, engine, on_gpus, decided on)
    ("hf-float32-cpu", {}, "hf", False, False),
    ("hf-bfloat16-engine", {"rollout": {"dtype": "bfloat16"}}, "hf", False, True),
    ("vllm-cpu", {}, "vllm", False, True),
    ("auto-dtype-on-gpu", {"model": {"dtype": "auto"}}, "hf", True, True),
    ("stale-samples", {"rollout": {"max_staleness": 1}}, "hf", False, True),
    ("forced-on", {"algo": {"rollout_correction": {"on": True}}}, "hf", False, True),
    (
        "forced-off",
        {"algo": {"rollout_correction": {"on": False}}, "rollout": {"dtype": "bfloat16"}},
        "vllm",
        True,
        False,
    ),
]


@pytest.mark.parametrize("case,overrides,engine,gpus,on", CASES, ids=[c[0] for c in CASES])
def test_auto_is_on_where_engine_and_learner_can_disagree(
    case: str, overrides: dict[str, Any], engine: str, gpus: bool, on: bool, tmp_path: Path
) -> None:
    base = small_trainer(tmp_path, **overrides)
    model = base.model.model_copy(
        update={"dtype": overrides.get("model", {}).get("dtype", "float32")}
    )
    settings = with_correction_decided(base.model_copy(update={"model": model}), engine, gpus)
    assert settings.algo.rollout_correction.on is on
    assert correction_on(settings) is on


def test_agreeing_engine_sends_nothing(tmp_path: Path) -> None:
    settings = with_correction_decided(
        small_trainer(tmp_path, model={"dtype": "float32"}), "hf", False
    )
    # the quickstart's numbers stay as they were
    assert not sends_engine_logprobs(settings, ahead=False)
    other = small_trainer(
        tmp_path,
        model={"dtype": "float32"},
        rollout={"dtype": "bfloat16"},
        algo={"rollout_correction": {"on": False}},
    )
    assert sends_engine_logprobs(other, ahead=False)  # measured, not corrected


def test_unset_bounds_are_the_decoupled_cap(tmp_path: Path) -> None:
    settings = small_trainer(tmp_path, algo={"behavior_weight_cap": 3.0})
    assert correction_bounds(settings.algo) == (0.0, 3.0)
    written = small_trainer(tmp_path, algo={"rollout_correction": {"low": 0.5, "high": 2.5}})
    assert correction_bounds(written.algo) == (0.5, 2.5)


DECIDED: list[tuple[dict[str, Any], bool, str, bool]] = [
    # (overrides, on_gpus, engine dtype, rollouts ahead)
    ({"model": {"dtype": "auto"}}, False, "float32", False),
    ({"model": {"dtype": "auto"}}, True, "bfloat16", False),
    ({"model": {"dtype": "auto"}, "rollout": {"dtype": "float16"}}, True, "float16", False),
    ({"model": {"dtype": "float32"}, "rollout": {"max_staleness": 2}}, True, "float32", True),
]


@pytest.mark.parametrize("overrides,gpus,dtype,ahead", DECIDED)
def test_engine_dtype_and_ahead_are_decided_from_the_settings(
    overrides: dict[str, Any], gpus: bool, dtype: str, ahead: bool, tmp_path: Path
) -> None:
    settings = small_trainer(tmp_path, **overrides)
    assert engine_dtype_name(settings, gpus) == dtype
    assert runs_ahead(settings) is ahead
