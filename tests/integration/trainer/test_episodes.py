"""Multi-turn episodes in the trainer on Ray: the synthetic tool task trains colocated (PPO)
and split (GRPO, rollouts a step ahead), its metrics and validation count episodes, and an
environment that breaks stops the run in one line with the last checkpoint intact."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from rlx.runs import read_metrics
from rlx.trainer.checkpoint import MARKER, open_manager
from rlx.trainer.main import trainer_for
from tests.support.cli import run_rlx
from tests.support.recipes import make_recipe, write_recipe

pytest.importorskip("ray")
pytestmark = pytest.mark.timeout(900)

TOOL_TASK = {
    "data": {"train": "synthetic:tool_lookup", "max_prompt_length": 64},
    "environment": {"function": "tool_lookup", "max_turns": 3, "max_tokens": 48},
    "rollout": {"engine": "hf", "n": 4, "max_new_tokens": 8},
    "batch": {"prompts_per_step": 2, "micro_batch_size": 8},
}
EPISODE_METRICS = ("episode/turns", "episode/tool_calls", "episode/length", "episode/failed")


def test_tool_episodes_train_colocated_and_split(tmp_path: Path, local_ray) -> None:
    validation = {"data": "synthetic:tool_lookup", "every": 2, "max_prompts": 4, "n": 2}
    # PPO: the critic values the model's tokens, GAE steps over the environment's.
    recipe = make_recipe(tmp_path, steps=2, algorithm="ppo", validation=validation, **TOOL_TASK)
    out = io.StringIO()
    with trainer_for(recipe, {"RLX_RUN_ID": "colocated"}, out) as trainer:
        assert trainer.run() == 2
        metrics = read_metrics(trainer.inputs.paths.run_dir / "metrics.jsonl")
    trained = [m for m in metrics if m["step"] > 0]
    for record in trained:
        assert all(name in record for name in EPISODE_METRICS), record
        assert 1 <= record["episode/turns"] <= 3 and record["episode/length_max"] <= 48
        assert record["episode/checked_tokens"] > 0 and record["episode/failed"] == 0
        assert "value/explained_variance" in record and "env/used_tool" in record
    assert "val/pass@1" in metrics[0] and "val/pass@1" in metrics[-1]

    split = make_recipe(
        tmp_path,
        "split",
        steps=3,
        layout="split",
        rollout_gpus=1,
        **{**TOOL_TASK, "rollout": {**TOOL_TASK["rollout"], "max_staleness": 1}},
    )
    with trainer_for(split, {"RLX_RUN_ID": "split"}, io.StringIO()) as trainer:
        assert trainer.run() == 3
        metrics = read_metrics(trainer.inputs.paths.run_dir / "metrics.jsonl")
    assert [m["staleness/max"] for m in metrics] == [0.0, 1.0, 1.0]
    assert all(m["episode/checked_tokens"] > 0 for m in metrics)


BREAKS_LATER = '''
import os

from rlx.trainer.tasks.tools import LookupTool


class BreaksLater(LookupTool):
    """The tool task's environment, whose service goes down after BREAK_AFTER episodes."""

    made = 0

    def reset(self, row):
        type(self).made += 1
        if type(self).made > int(os.environ.get("BREAK_AFTER", "1000000")):
            raise RuntimeError("the lookup service is down")
        super().reset(row)
'''


def test_a_broken_environment_stops_the_run_with_the_checkpoint_intact(tmp_path: Path) -> None:
    (tmp_path / "envs.py").write_text(BREAKS_LATER)
    recipe = write_recipe(
        tmp_path,
        "broken",
        steps=4,
        checkpoint={"dir": str(tmp_path / "ckpt"), "every": 2, "keep": 2},
        **{
            **TOOL_TASK,
            "environment": {**TOOL_TASK["environment"], "function": "envs.py:BreaksLater"},
        },
    )
    # 8 episodes a step: the service goes down during step 3.
    broken = run_rlx(["train", str(recipe)], tmp_path, RLX_RUN_ID="broken", BREAK_AFTER="16")
    assert broken.returncode == 1, broken.stderr[-3000:]
    assert "Traceback" not in broken.stderr
    error = [line for line in broken.stderr.splitlines() if "max_failed_fraction" in line]
    assert error == [
        "error: step 3: 8 of 8 episodes failed in environment envs.py:BreaksLater, more than "
        "trainer.environment.max_failed_fraction 0.5 allows; the run stops (the last checkpoint "
        "is kept); fix the environment and resume"
    ], broken.stderr[-2000:]
    assert (
        "step 3: episode 0 (prompt row" in broken.stdout
        and "failed at reset: reset() raised RuntimeError: the lookup service is down"
        in broken.stdout
    )
    # The last good checkpoint is whole (its COMPLETE marker written) and the one a resume
    # takes; nothing of the failed step was saved.
    manager = open_manager(tmp_path / "ckpt", "broken", keep=2)
    assert [p.name for p in manager.checkpoints()] == ["step-000002"]
    latest = manager.latest()
    assert latest is not None and latest.name == "step-000002"
    assert (latest / MARKER).is_file()
    state = json.loads((tmp_path / "runs" / "broken" / "result.json").read_text())
    assert state["state"] == "FAILED" and "max_failed_fraction" in state["error"]
