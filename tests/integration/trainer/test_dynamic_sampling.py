"""Dynamic sampling on the real trainer: every trained step has prompts_per_step groups whose
scores differ (more prompts generated where the first ones did not), with DAPO's overlong
handling and the rollout correction on (a bfloat16 engine beside a float32 learner), and a
run resumed from its step-2 checkpoint trains steps 3-4 exactly as the uninterrupted one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlx.runs import read_metrics
from rlx.trainer.main import run_training
from tests.support.recipes import make_recipe

pytestmark = pytest.mark.timeout(900)

PROMPTS = 4
# letters_or_digits scores each response's share of the characters asked for: the random
# policy's responses mostly score 0, so some groups of 4 score 0 alike and are dropped.
SETTINGS = {
    "model": {"dtype": "float32"},
    "rollout": {"n": 4, "max_new_tokens": 12, "dtype": "bfloat16"},
    "batch": {
        "prompts_per_step": PROMPTS,
        "micro_batch_size": 16,
        "filter_groups": {"max_rounds": 8},
    },
    # The random policy rarely ends a response within 12 tokens: masking cut ones would leave
    # nothing to train (tests/unit has that case); the soft penalty shapes the advantages.
    "algo": {"kl": {"coef": 0.0}, "overlong": {"buffer": 4}},
}


def _steps(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl") if "reward/mean" in r}


def test_every_step_trains_varied_groups_and_a_resume_is_exact(tmp_path: Path, local_ray) -> None:
    checkpoint = {"every": 2, "keep": 2}

    def run(run_id: str, steps: int) -> dict[int, dict]:
        recipe = make_recipe(
            tmp_path,
            steps=steps,
            checkpoint={**checkpoint, "dir": str(tmp_path / "ckpt" / run_id)},
            **SETTINGS,
        )
        result = run_training(recipe, {"RLX_RUN_ID": run_id})
        assert result.state == "SUCCEEDED" and result.last_step == steps
        return _steps(tmp_path / "runs" / run_id)

    straight = run("straight", 4)
    assert sorted(straight) == [1, 2, 3, 4]
    for step, record in straight.items():
        assert record["batch/kept_groups"] == PROMPTS, (step, record)
        assert record["mismatch/kl"] > 0, record  # the correction's measure, every step
        assert 0 <= record["overlong/truncated_fraction"] <= 1, record
    rounds = [record["batch/sampling_rounds"] for record in straight.values()]
    dropped = [record["batch/dropped_groups"] for record in straight.values()]
    print(f"sampling rounds per step {rounds}, dropped groups {dropped}")
    assert max(rounds) > 1 and sum(dropped) > 0, (rounds, dropped)

    run("resumed", 2)
    resumed = run("resumed", 4)
    for step in (3, 4):
        ours, theirs = resumed[step], straight[step]
        for name in ("reward/mean", "batch/sampling_rounds", "batch/dropped_groups"):
            assert ours[name] == theirs[name], (step, name, ours[name], theirs[name])
        for name in ("loss/policy", "grad_norm", "mismatch/kl"):
            assert ours[name] == pytest.approx(theirs[name], rel=1e-6, abs=1e-9), (step, name)
    samples = [
        json.loads(line)
        for run_id in ("straight", "resumed")
        for line in (tmp_path / "runs" / run_id / "samples.jsonl").read_text().splitlines()
    ]
    prompts = {(s["step"], tuple(s["prompts"])) for s in samples if s["step"] in (3, 4)}
    assert len(prompts) == 2, prompts  # the same prompts trained at steps 3 and 4
