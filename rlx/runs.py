"""Training progress for `rlx status`, from a run folder this machine can read (a local run,
or a Slurm job whose logging folder is on the shared filesystem): step of total, last
reward, elapsed time and an estimate of the time left."""

from __future__ import annotations

import re
import time
from pathlib import Path

# What `rlx train` prints on the head once it knows its run folder.
RUN_LINE = re.compile(r"rlx train: run (\S+), outputs in (.+?)\s*$", re.MULTILINE)


def run_dir_from_log(text: str) -> Path | None:
    """The newest run folder a head log names (a requeued job names one per attempt)."""
    found = RUN_LINE.findall(text)
    return Path(found[-1][1]) if found else None


def _duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def progress_detail(run_dir: Path, now: float | None = None) -> str | None:
    """'step 12 of 100, reward 0.412, 3m05s elapsed, ETA 22m40s'; None without a record."""
    from rlx.trainer.report.metrics import REWARD_MEAN, read_metrics
    from rlx.trainer.report.record import read_result
    from rlx.trainer.resolve import METRICS_FILE

    record = read_result(run_dir)
    if record is None:
        return None
    rows = read_metrics(run_dir / METRICS_FILE)
    step = rows[-1]["step"] if rows else 0
    parts = [f"step {step} of {record.steps}"]
    reward = next((r[REWARD_MEAN] for r in reversed(rows) if REWARD_MEAN in r), None)
    if reward is not None:
        parts.append(f"reward {reward:.3f}")
    if record.started is not None:
        end = record.finished if record.finished else (now or time.time())
        elapsed = end - record.started
        parts.append(f"{_duration(elapsed)} elapsed")
        if record.state == "RUNNING" and rows and step > 0:
            # At the pace of the steps the metrics file holds since its first one.
            done = step - rows[0]["step"] + 1
            rate = elapsed / max(done, 1)
            parts.append(f"ETA {_duration(rate * (record.steps - step))}")
    return ", ".join(parts)
