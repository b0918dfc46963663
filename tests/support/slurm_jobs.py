"""`rlx launch -b slurm` on the test Slurm and the job it makes, followed to its end."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class SlurmRun:
    job: Any  # tests.support.hosts.SlurmJob: state, exit code, nodes
    folder: Path  # the job's log folder (rlx-logs/NAME-ID)
    logs: dict[str, str]  # every log in it, by file name
    seconds: float  # from the launch to the job's end

    def report(self) -> str:
        """Every log of the job in full, for a failed assertion (a dict's repr is cut short)."""
        return "\n".join(f"--- {name}\n{text}" for name, text in sorted(self.logs.items()))


def launch_and_wait(
    cluster: Any,
    argv: Sequence[str],
    cwd: Path,
    env: Mapping[str, str],
    name: str,
    timeout: float,
) -> SlurmRun:
    """Run the launch `argv` (an `rlx launch RECIPE -b slurm`) in cwd with env, then wait for
    the one job it submitted to end; its record, folder and logs."""
    started = time.monotonic()
    done = subprocess.run(
        list(argv), cwd=cwd, env=dict(env), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    [job_id] = cluster.active_jobs()
    job = cluster.wait_job(job_id, timeout=timeout)
    folder = cwd / "rlx-logs" / f"{name}-{job_id}"
    logs = {p.name: p.read_text(errors="replace") for p in folder.glob("*.log")}
    return SlurmRun(job, folder, logs, time.monotonic() - started)
