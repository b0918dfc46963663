"""`rlx status` progress from a run folder: step of total, last reward, elapsed, ETA."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from rlx.runs import RunResult, progress_detail, run_dir_from_log


def write_run(run_dir: Path, state: str, steps: int, rewards: list[float], started: float) -> None:
    run_dir.mkdir(parents=True)
    result = RunResult(state=state, run_id="r", run_dir=str(run_dir), steps=steps, started=started)
    (run_dir / "result.json").write_text(json.dumps(asdict(result)))
    lines = [
        json.dumps({"step": i + 1, "time": started + 10 * (i + 1), "reward/mean": r})
        for i, r in enumerate(rewards)
    ]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_running_job_shows_step_reward_elapsed_and_eta(tmp_path: Path) -> None:
    write_run(tmp_path / "run", "RUNNING", 100, [0.1, 0.2, 0.25, 0.5], started=1000.0)
    # 4 steps in 120 s: 30 s a step, 96 steps left.
    detail = progress_detail(tmp_path / "run", now=1120.0)
    assert detail == "step 4 of 100, reward 0.500, 2m00s elapsed, ETA 48m00s"


def test_no_record_no_progress(tmp_path: Path) -> None:
    assert progress_detail(tmp_path) is None


def test_the_newest_run_the_head_log_names(tmp_path: Path) -> None:
    log = (
        "rlx node 0 ...\nrlx train: run a-1, outputs in /shared/runs/a-1\n"
        "rlx train: run a-1, outputs in /shared/runs/a 2\n"
    )
    assert run_dir_from_log(log) == Path("/shared/runs/a 2")
    assert run_dir_from_log("nothing here") is None
