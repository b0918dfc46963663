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


def test_status_names_the_newest_complete_checkpoint(tmp_path: Path) -> None:
    from rlx.checkpoints import MARKER, newest_complete_step

    ckpt = tmp_path / "ckpt" / "r"
    for step, complete in ((2, True), (4, True), (6, False)):
        folder = ckpt / f"step-{step:06d}"
        folder.mkdir(parents=True)
        if complete:
            (folder / MARKER).write_text(json.dumps({"format": 1, "step": step}))
    (ckpt / "step-000008").mkdir()
    (ckpt / "step-000008" / MARKER).write_text(json.dumps({"format": 1, "step": 7}))  # wrong
    assert newest_complete_step(ckpt) == str(ckpt / "step-000004")
    write_run(tmp_path / "run", "RUNNING", 100, [0.1], started=1000.0)
    record = json.loads((tmp_path / "run" / "result.json").read_text())
    record["checkpoints"] = str(ckpt)
    (tmp_path / "run" / "result.json").write_text(json.dumps(record))
    detail = progress_detail(tmp_path / "run", now=1010.0)
    assert detail is not None and detail.endswith(f"newest checkpoint {ckpt / 'step-000004'}")
    assert newest_complete_step(tmp_path / "nowhere") is None
