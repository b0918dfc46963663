"""What Slurm says about a submitted job, and the files the job writes: its state (squeue
while the controller holds it, then sacct, or scontrol while it still remembers it), its
folder per attempt, the nodes its driver log names, and the commands that ask."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from pathlib import Path

from rlx.errors import RlxError
from rlx.launchers.base import Job
from rlx.launchers.slurm.render import nodes_from_driver_log

TERMINAL = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
}


STATE_NAMES = {
    "COMPLETED": "SUCCEEDED",
    "PENDING": "PENDING",
    "CONFIGURING": "PENDING",
    "RUNNING": "RUNNING",
    "COMPLETING": "RUNNING",
    "CANCELLED": "CANCELLED",
}


def run_slurm(
    argv: list[str],
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            env=None if env is None else dict(env),
            cwd=cwd,
            timeout=120,
            check=False,
        )
    except FileNotFoundError:
        raise RlxError(
            f"`{argv[0]}` is not installed here; run rlx on a Slurm login node"
        ) from None
    except subprocess.TimeoutExpired:
        raise RlxError(
            f"`{' '.join(argv[:2])}` did not answer within 120 s; is slurmctld up? (try `sinfo`)"
        ) from None
    if check and proc.returncode != 0:
        message = (proc.stderr or proc.stdout).strip().splitlines()
        raise RlxError(f"{argv[0]} failed: {message[-1] if message else proc.returncode}")
    return proc


def job_state(job: Job) -> tuple[str, int | None, str]:
    """(Slurm state, exit code if known, reason)."""
    proc = run_slurm(["squeue", "-h", "-j", job.handle, "-o", "%T|%r"], check=False)
    line = proc.stdout.strip()
    if proc.returncode == 0 and line:
        state, _, reason = line.partition("|")
        return state, None, "" if reason in ("None", "") else reason
    proc = run_slurm(
        ["sacct", "-n", "-X", "-P", "-j", job.handle, "-o", "State,ExitCode"], check=False
    )
    line = proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else ""
    if proc.returncode == 0 and line:
        state, _, code = line.partition("|")
        return state.split()[0], int(code.split(":")[0] or 0), ""
    proc = run_slurm(["scontrol", "show", "job", job.handle, "-o"], check=False)
    fields = dict(kv.split("=", 1) for kv in proc.stdout.split() if "=" in kv)
    if proc.returncode == 0 and "JobState" in fields:
        code = fields.get("ExitCode", "0:0").split(":")[0]
        return fields["JobState"], int(code) if code.isdigit() else None, fields.get("Reason", "")
    return "UNKNOWN", None, "the controller no longer knows this job (see its logs)"


def attempt_folder(job: Job) -> Path:
    """The log folder of the job's newest attempt (a requeued job has one per attempt)."""
    first = Path(job.extra["logs"])
    later = [
        (int(p.name.rsplit("attempt", 1)[1]), p)
        for p in first.parent.glob(f"{first.name}-attempt*")
        if p.name.rsplit("attempt", 1)[1].isdigit()
    ]
    return max(later)[1] if later else first


def job_hosts(folder: Path) -> list[str]:
    """The job's nodes, head first, as the driver log of this attempt names them."""
    driver = folder / "driver.log"
    if not driver.exists():
        return []
    return nodes_from_driver_log(driver.read_text(errors="replace"))
