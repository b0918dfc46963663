"""Local: run the whole job on this machine, in the foreground, with a private Ray.

`rlx launch RECIPE` (the default backend) trains in this process: progress bars, then a
summary table. Each launch is a new run, `<name>-<date>-<time>`, unless RLX_RUN_ID names
one (set it to an earlier run's id to continue that run from its checkpoints). The job is
remembered as soon as it starts, so `rlx status`, `rlx logs` and `rlx down` work from
another terminal while it runs; they read the run folder (result.json, metrics.jsonl,
train.log) and stop the launching process by its pid.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from rlx import procfs
from rlx.errors import RlxError
from rlx.launchers.base import Job, JobStatus, LaunchRequest, remember
from rlx.launchers.local import BACKEND
from rlx.launchers.local.render import refuse_elsewhere
from rlx.node.env import RUN_ID_ENV, environment
from rlx.recipe import Recipe

if TYPE_CHECKING:
    from rlx.runs import RunResult

STOP_GRACE_SECONDS = 60.0
POLL_SECONDS = 0.5


def run_id_for(name: str, env: Mapping[str, str]) -> str:
    explicit = env.get(RUN_ID_ENV, "").strip()
    return explicit or f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def launch(request: LaunchRequest) -> Job:
    from rlx.trainer.resolve import run_paths

    recipe = request.recipe
    refuse_elsewhere(recipe)
    run_id = run_id_for(request.name, os.environ)
    values = {**recipe.env, **request.secrets, RUN_ID_ENV: run_id}
    job = request.job(BACKEND.name, str(os.getpid()), run_id=run_id)
    if recipe.trainer is None or recipe.command is not None:
        job.extra["exit_code"] = str(_run_command(recipe, values, job, request.workdir))
        return job
    paths = run_paths(recipe.name, recipe.trainer, {**os.environ, **values})
    job.extra["run_dir"] = str(paths.run_dir)
    remember(job, request.workdir)  # visible to status/logs/down while it runs
    with environment(values):  # Ray's workers inherit it
        code = _train(recipe, paths.run_dir)
    job.extra["exit_code"] = str(code)
    return job


def _train(recipe: Recipe, run_dir: Path) -> int:
    from rlx.runs import read_result
    from rlx.trainer.main import run_training
    from rlx.trainer.report.console import Stopped

    try:
        result = run_training(recipe, print_summary=False)
    except Stopped as stop:
        print(f"stopped ({stop}); `rlx launch` again with RLX_RUN_ID to continue", file=sys.stderr)
        return stop.code
    record = read_result(run_dir) or result
    print_summary(record)
    return 0


def _run_command(recipe: Recipe, values: Mapping[str, str], job: Job, workdir: Path) -> int:
    """A recipe whose head runs its own `command`: the node bootstrap, on this one node."""
    from rlx.node import bootstrap
    from rlx.node.env import job_node_info

    remember(job, workdir)
    env = {**os.environ, **values}
    return bootstrap.main(recipe, job_node_info(BACKEND.name, env, recipe.resources), env)


def _shown(path: str | None) -> str:
    """A path relative to the current folder when it is below it (shorter to read)."""
    if not path:
        return "-"
    with contextlib.suppress(ValueError):
        return str(Path(path).relative_to(Path.cwd()))
    return path


def print_summary(record: RunResult) -> None:
    from rich.console import Console
    from rich.table import Table

    from rlx.trainer.report.record import best_summary, reward_summary, validation_lines

    table = Table(title=f"run {record.run_id}: {record.state.lower()}", show_header=False)
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")
    table.add_row("steps", f"{record.last_step} of {record.steps}")
    table.add_row("reward", reward_summary(record))
    for line in validation_lines(record):
        table.add_row("validation", line.removeprefix("validation: "))
    if record.wall_time_s is not None:
        table.add_row("training time", f"{record.wall_time_s:.1f} s")
    if record.started is not None and record.finished is not None:
        table.add_row("wall time", f"{record.finished - record.started:.1f} s (start-up included)")
    table.add_row("checkpoints", _shown(record.checkpoints) if record.checkpoints else "off")
    if record.best:
        table.add_row("best checkpoint", best_summary(record.best))
    table.add_row("reward plot", _shown(record.plot))
    table.add_row("metrics", _shown(record.metrics))
    table.add_row("log", _shown(record.log))
    Console(soft_wrap=True).print(table)


# --------------------------------------------------------------------------- operate


def _pid_running(job: Job) -> bool:
    """The launching process is alive, and is an rlx process (not a reused pid)."""
    if not job.handle.isdigit():
        return False
    pid = int(job.handle)
    return procfs.running(pid) and "rlx" in "\0".join(procfs.cmdline(pid))


def status(job: Job) -> JobStatus:
    found = _status(job)
    # Up while the launching process is: the run's Ray and every process it starts end with it.
    ended = found.ended_at if found.ended_at is not None else job.ended_at
    return replace(found, up=_pid_running(job), ended_at=ended)


def _status(job: Job) -> JobStatus:
    from rlx.runs import read_result

    running = _pid_running(job)
    run_dir = job.extra.get("run_dir")
    record = read_result(Path(run_dir)) if run_dir else None
    if record is None:
        if "exit_code" in job.extra:
            code = int(job.extra["exit_code"])
            state = "SUCCEEDED" if code == 0 else "FAILED"
            return JobStatus(job.name, BACKEND.name, state, f"exit code {code}", code)
        state = "RUNNING" if running else "UNKNOWN"
        return JobStatus(job.name, BACKEND.name, state, "starting" if running else "no record")
    ended = record.finished
    if record.state == "RUNNING":
        if not running:
            return JobStatus(
                job.name,
                BACKEND.name,
                "FAILED",
                f"stopped without finishing (pid {job.handle} is gone)",
                ended_at=ended,
            )
        from rlx.runs import progress_detail

        detail = progress_detail(Path(run_dir)) if run_dir else None
        return JobStatus(job.name, BACKEND.name, "RUNNING", detail or "starting")
    if record.state == "SUCCEEDED":
        detail = f"{record.last_step} steps"
        if record.first_reward_window is not None and record.last_reward_window is not None:
            first, last = record.first_reward_window, record.last_reward_window
            detail += f", reward {first:.3f} -> {last:.3f}"
        return JobStatus(job.name, BACKEND.name, "SUCCEEDED", detail, 0, ended_at=ended)
    return JobStatus(
        job.name, BACKEND.name, record.state, record.error or "", record.exit_code, ended_at=ended
    )


def _log_path(job: Job) -> Path:
    from rlx.runs import LOG_FILE

    run_dir = job.extra.get("run_dir")
    if not run_dir:
        raise RlxError(f"job {job.name} ran a command, not the trainer: it keeps no log file")
    return Path(run_dir) / LOG_FILE


def logs(job: Job, *, follow: bool, node: int | None) -> int:
    if node not in (None, 0):
        raise RlxError(f"a local job has one node (0); there is no node {node}")
    path = _log_path(job)
    if not path.exists():
        raise RlxError(f"no log yet at {path} (rlx status {job.name})")
    offset = 0

    def drain() -> None:
        nonlocal offset
        with path.open("rb") as f:
            f.seek(offset)
            chunk = f.read()
        offset += len(chunk)
        sys.stdout.write(chunk.decode(errors="replace"))
        sys.stdout.flush()

    drain()
    while follow and _pid_running(job):
        time.sleep(POLL_SECONDS)
        drain()
    if follow:
        drain()
    return 0


def down(job: Job) -> None:
    if not _pid_running(job):
        state = status(job)
        raise RlxError(f"{job.name} is not running ({state.state.lower()}); nothing to stop")
    pid = int(job.handle)
    # SIGINT, a person's stop: the trainer stops between operations and releases its Ray
    # (SIGTERM would mean a preemption: checkpoint first, exit 75); then SIGKILL.
    for sig, wait in ((signal.SIGINT, STOP_GRACE_SECONDS), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not _pid_running(job):
                return
            time.sleep(POLL_SECONDS)
    raise RlxError(f"process {pid} of {job.name} did not stop")
