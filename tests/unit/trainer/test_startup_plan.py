"""The start-up plan is made once: `rlx train` on the quickstart recipe plans it one time (its
checkpoint probes, the strategy and the GPU summary all read that plan), and a recipe that
leaves a size to `auto` adds only the choice of its sizes."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from rlx.recipe.load import load_recipe
from rlx.trainer.job import TrainJob
from rlx.trainer.startup import StartPlan

ROOT = Path(__file__).resolve().parents[3]


def planner_runs_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("planner_runs", ROOT / "bench/planner_runs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_one_plan_per_start_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs = planner_runs_module()
    monkeypatch.chdir(tmp_path)  # the recipe's folders are relative
    assert runs.planner_runs(runs.quickstart(ROOT)) == ["plan_recipe"]
    sized = runs.planner_runs(runs.quickstart(ROOT, auto=True))
    assert sized == ["size_recipe", "plan_recipe"]


def test_the_job_carries_its_plan() -> None:
    recipe = load_recipe(ROOT / "recipes" / "quickstart.yaml").recipe
    plan = StartPlan(recipe, {})
    job = TrainJob.of(recipe, plan=plan)
    assert job.plan is plan
    made = plan.memory()
    assert made is not None and plan.memory() is made
    assert plan.checkpoint_sizes() == (made.checkpoint_bytes, made.checkpoint_bytes)
    assert plan.strategy() == made.strategy_choice
    assert plan.gpu_peak_gib() is None  # a CPU recipe plans no GPU


def test_no_plan_is_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan that cannot be made yet (the model's config not on this node) is asked again."""
    from rlx.plan import planner
    from rlx.plan.shapes import PlanError

    recipe = load_recipe(ROOT / "recipes" / "quickstart.yaml").recipe
    tries = []

    def refuse(*args: object, **kwargs: object) -> None:
        tries.append(1)
        raise PlanError("no config.json found")

    monkeypatch.setattr(planner, "plan_recipe", refuse)
    plan = StartPlan(recipe, {})
    assert plan.checkpoint_sizes() == (0, 0)
    assert plan.gpu_peak_gib() is None
    assert plan.strategy().strategy == "single"
    assert len(tries) == 3
