"""Rollouts ahead of training (trainer.rollout.max_staleness, layout: split, on CPU): every
trained batch is within the bound and says so in its metrics, a sample one version too old
stops the run with one line, and a run killed with batches in flight resumes training every
prompt once, in the order a straight run would."""

from __future__ import annotations

import dataclasses
import io
import json
import random
from pathlib import Path

import pytest

from rlx.runs import SAMPLES_FILE, read_metrics
from rlx.trainer.inflight import RolloutQueue, StalenessError
from rlx.trainer.main import trainer_for
from rlx.trainer.resolve import SYNTHETIC_ROWS
from rlx.trainer.tasks.data import PromptSampler
from tests.support.cli import run_rlx
from tests.support.fixtures import ray_nodes_here
from tests.support.recipes import make_recipe, write_recipe

pytest.importorskip("ray")
pytestmark = pytest.mark.timeout(900)

ASYNC = {
    "layout": "split",
    "rollout_gpus": 1,  # on CPU: one rollout actor beside the training worker
    "rollout": {"n": 4, "max_new_tokens": 12, "max_staleness": 2},
    "batch": {"prompts_per_step": 3, "micro_batch_size": 12},
}


def test_batches_stay_within_the_bound_and_a_staler_one_stops_the_run(tmp_path, local_ray):
    recipe = make_recipe(tmp_path, steps=4, **ASYNC)
    out = io.StringIO()
    with trainer_for(recipe, {"RLX_RUN_ID": "ahead"}, out) as trainer:
        assert trainer.run() == 4
        run_dir = trainer.inputs.paths.run_dir
        metrics = read_metrics(run_dir / "metrics.jsonl")
        # Steps 1..3 train on rollouts started before any update; from then on each batch is
        # exactly k = 2 versions old (started right after the push of version t - 3).
        assert [m["staleness/max"] for m in metrics] == [0.0, 1.0, 2.0, 2.0]
        assert [m["staleness/share_2"] for m in metrics] == [0.0, 0.0, 1.0, 1.0]
        for record in metrics:
            assert record["offpolicy/weight_mean"] > 0 and record["offpolicy/weight_std"] >= 0
            assert 0 <= record["offpolicy/truncated_frac"] <= 1
        # Each push is queued behind the engines' rollouts and proven one step later (the
        # last one at the run's end): steps 2..4 report the pushes of versions 1..3.
        tolerance = trainer.inputs.probe.tolerance("float32")
        assert "sync/probe_diff" not in metrics[0]
        assert all(record["sync/probe_diff"] <= tolerance for record in metrics[1:])
        samples = [json.loads(line) for line in (run_dir / SAMPLES_FILE).read_text().splitlines()]
        assert [s["versions"] for s in samples] == [[0] * 3, [0] * 3, [0] * 3, [1] * 3]
        assert "stale 2.00" in out.getvalue()  # the console shows it too

        # One sample older than the bound allows: the step stops with one line.
        class Older:
            def __init__(self, pending):
                self.pending = pending

            def collect(self, show_progress):
                batch = self.pending.collect(show_progress)
                versions = batch.row_versions.clone()
                versions[0] -= 3  # policy 4, engines at 4: one sample at version 1 (lag 3)
                return dataclasses.replace(batch, versions=versions)

        trainer.queue = RolloutQueue(
            trainer.sampler, lambda rows, step: Older(trainer.submit_rollout(rows, step)), 2, 5
        )
        with pytest.raises(StalenessError) as caught:
            trainer.step(5)
        assert str(caught.value) == (
            "step 5: 1 of 12 samples were made by weights version 1 but the policy is at "
            "version 4 and trainer.rollout.max_staleness 2 allows 2..4; the run stops (a "
            "weight push or the rollout queue is wrong)"
        )


def test_a_kill_with_batches_in_flight_resumes_every_prompt_once(tmp_path: Path):
    steps, every = 6, 2
    kill_at = random.Random().randint(2, steps - 1)  # any point must do; say which
    print(f"killed after step {kill_at}")
    recipe = write_recipe(
        tmp_path,
        "killed",
        steps=steps,
        checkpoint={"dir": str(tmp_path / "ckpt"), "every": every, "keep": 2},
        **ASYNC,
    )
    with ray_nodes_here(2) as cluster:
        common = {"RLX_RUN_ID": "killed", "RAY_ADDRESS": cluster.address, "RLX_NUM_THREADS": "1"}
        killed = run_rlx(
            ["train", str(recipe)], tmp_path, RLX_TEST_KILL_AT=f"step:{kill_at}", **common
        )
        assert killed.returncode == -9, killed.stderr[-3000:]
        resumed = run_rlx(["train", str(recipe)], tmp_path, **common)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    saved = kill_at - kill_at % every
    if saved:
        assert f"(step {saved})" in resumed.stdout
    run_dir = tmp_path / "runs" / "killed"
    samples = [json.loads(line) for line in (run_dir / SAMPLES_FILE).read_text().splitlines()]
    assert [s["step"] for s in samples] == list(range(1, steps + 1))
    # The prompts the checkpoint's lineage trained, step by step, are a straight run's:
    # none twice, none skipped, though steps saved + 1 .. saved + 2 were in flight.
    sampler = PromptSampler(SYNTHETIC_ROWS, 3, seed=0)
    assert [s["prompts"] for s in samples] == [next(sampler) for _ in range(steps)]
    for s in samples:
        lag = [s["step"] - 1 - v for v in s["versions"]]
        assert all(0 <= x <= 2 for x in lag), s
