"""A bfloat16 engine beside a float32 learner (trainer.rollout.dtype) samples from a slightly
different policy: every step measures the gap on every sampled token (mismatch/kl > 0) and,
with algo.rollout_correction's auto on, weighs it back (weight mean near 1)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlx.runs import read_metrics
from rlx.trainer.main import run_training
from tests.support.recipes import make_recipe

pytestmark = pytest.mark.timeout(300)


def test_a_bfloat16_engine_logs_its_mismatch_every_step(tmp_path: Path, local_ray) -> None:
    recipe = make_recipe(
        tmp_path,
        steps=3,
        model={"dtype": "float32"},
        rollout={"n": 4, "max_new_tokens": 12, "dtype": "bfloat16"},
        batch={"prompts_per_step": 4, "micro_batch_size": 16},
    )
    result = run_training(recipe, {"RLX_RUN_ID": "bf16"})
    assert result.state == "SUCCEEDED" and result.last_step == 3
    records = [
        r for r in read_metrics(tmp_path / "runs" / "bf16" / "metrics.jsonl") if "reward/mean" in r
    ]
    assert len(records) == 3
    for record in records:
        assert 0 < record["mismatch/kl"] < 0.05, record
        assert record["mismatch/max_abs_logprob_diff"] > 0, record
        assert abs(record["mismatch/weight_mean"] - 1) < 0.05, record
        assert 0 <= record["mismatch/truncated_fraction"] <= 1, record
