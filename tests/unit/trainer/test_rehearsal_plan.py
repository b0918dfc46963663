"""What a dress rehearsal changes in a recipe (rlx rehearse --dry-run): only the model's size
and the accelerators, and the counts that shrink with them."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlx.errors import RlxError
from rlx.recipe import load_recipe, parse_recipe
from rlx.trainer.rehearsal import (
    CHECKPOINT_STEP,
    STEPS,
    RayNode,
    RehearsalResult,
    RunOutcome,
    plan_rehearsal,
)
from tests.conftest import RECIPES
from tests.support.cli import assert_one_line_error, invoke
from tests.support.recipes import write_shipped_variant

KEPT = (
    "trainer.algorithm",
    "trainer.layout",
    "trainer.model.path",
    "trainer.checkpoint.dir",
    "trainer.logging.dir",
    "trainer.rollout.engine",
    "trainer.rollout.max_staleness",
    "trainer.reward.function",
    "trainer.environment.function",
)


@pytest.mark.parametrize(
    ("name", "nodes", "strategy"),
    [
        ("ppo-7b", [RayNode(2)] * 2, "fsdp"),
        ("grpo-large", [RayNode(2)] * 2, "fsdp"),
        ("grpo-async", [RayNode(2, "train"), RayNode(1, "rollout"), RayNode(1, "rollout")], "fsdp"),
        ("gsm8k-grpo", [RayNode(1)] * 2, "ddp"),
        ("gsm8k-tools", [RayNode(1)] * 2, "ddp"),
    ],
)
def test_a_rehearsal_keeps_the_recipe_but_size_and_accelerators(name, nodes, strategy) -> None:
    shipped = load_recipe(RECIPES / f"{name}.yaml").recipe
    plan = plan_rehearsal(shipped)
    changed = {path for path, _, _ in plan.changes}
    assert not changed & set(KEPT)
    assert plan.nodes == nodes
    rehearsal = plan.recipe.trainer
    assert rehearsal.parallel.strategy == strategy  # what the GPU run chooses, pinned
    assert rehearsal.model.dtype == "float32" and rehearsal.steps == 3
    assert rehearsal.rollout.tensor_parallel_size == min(
        shipped.trainer.rollout.tensor_parallel_size, 2
    )
    assert plan.models.keys() == {shipped.trainer.model.path}
    # Several minibatches stay several; every training rank gets a prompt's samples.
    batch = rehearsal.batch
    samples = batch.prompts_per_step * rehearsal.rollout.n
    assert samples // (batch.minibatch_size or samples) == 2


def test_dry_run_says_what_changes_and_a_command_recipe_is_refused(tmp_path: Path) -> None:
    result = invoke(["rehearse", str(RECIPES / "grpo-large.yaml"), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "resources.accelerators" in result.output and "H100:8 -> H100:2" in result.output
    assert "trainer.rollout.tensor_parallel_size  4 -> 2" in result.output
    recipe = parse_recipe("name: bring-up\nresources: {nodes: 2}\ncommand: [python x.py]\n").recipe
    with pytest.raises(RlxError, match="there is nothing to rehearse"):
        plan_rehearsal(recipe)
    path = tmp_path / "cmd.yaml"
    path.write_text("name: bring-up\nresources: {nodes: 2}\ncommand: [python x.py]\n")
    assert_one_line_error(invoke(["rehearse", str(path)]), "there is nothing to rehearse")


def test_a_recipe_start_up_refuses_is_refused_before_it_is_scaled(tmp_path: Path) -> None:
    # a minibatch larger than a step's 512 sequences: start-up's line, not a ZeroDivisionError
    path = write_shipped_variant(tmp_path, "grpo-async.yaml", trainer__batch__minibatch_size=1024)
    with pytest.raises(RlxError, match="minibatch_size 1024 does not divide the 512 sequences"):
        plan_rehearsal(load_recipe(path).recipe)
    assert_one_line_error(invoke(["rehearse", "--dry-run", str(path)]), "minibatch_size 1024")


def test_nodes_that_never_start_in_time_are_one_line_and_other_errors_pass_through() -> None:
    from rlx.trainer.main import NODE_START_TRIES, RAYLET_LATE, started_on_a_busy_machine

    calls = []

    def late() -> None:
        calls.append(1)
        raise Exception(f"The current node {RAYLET_LATE}.")

    with pytest.raises(RlxError, match="missed Ray's 30 s to register 3 times"):
        started_on_a_busy_machine(late, "the rehearsal's Ray nodes")
    assert len(calls) == NODE_START_TRIES

    def broken() -> None:
        raise ValueError("num_gpus must be >= 0")

    with pytest.raises(ValueError, match="num_gpus"):
        started_on_a_busy_machine(broken, "the rehearsal's Ray nodes")


def test_a_rehearsal_without_its_resume_passes_on_the_checkpoint_run_alone() -> None:
    plan = plan_rehearsal(load_recipe(RECIPES / "gsm8k-grpo.yaml").recipe)
    saved = RunOutcome("SUCCEEDED", CHECKPOINT_STEP, [1, 2], 1.0)
    resumed = RunOutcome("SUCCEEDED", STEPS, [1, 2, 3], 1.0)
    assert RehearsalResult(plan, "r", [saved], "gs://b", resumed=False).passed
    assert RehearsalResult(plan, "r", [saved, resumed], "gs://b").passed
    # Asked for, the resume must have run and reached step 3.
    assert not RehearsalResult(plan, "r", [saved], "gs://b").passed
    stopped = RunOutcome("FAILED", None, [1, 2], 1.0, "an error")
    assert not RehearsalResult(plan, "r", [saved, stopped], "gs://b").passed
    assert not RehearsalResult(plan, "r", [stopped], "gs://b", resumed=False).passed
