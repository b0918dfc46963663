"""Operate Slurm jobs with Slurm's own commands: sbatch submits (the job id is the handle),
squeue/sacct/scontrol report (jobs.py), the job's log files are the logs, scancel stops it;
`rlx attach` and `rlx tunnel` run a step inside the job's allocation (attach.py)."""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

from rlx.errors import RlxError
from rlx.launchers.base import Job, JobStatus, LaunchRequest
from rlx.launchers.keep import save_token
from rlx.launchers.ops_common import save_rendered
from rlx.launchers.slurm import BACKEND
from rlx.launchers.slurm.containers import attach_container
from rlx.launchers.slurm.jobs import (
    STATE_NAMES,
    TERMINAL,
    attempt_folder,
    job_hosts,
    job_state,
    run_slurm,
)
from rlx.launchers.slurm.render import log_dir
from rlx.node.env import RAY_TOKEN_SECRET, WHEEL_ENV
from rlx.recipe.model import RaySettings


def launch(request: LaunchRequest) -> Job:
    script = save_rendered(request, BACKEND.suffix)
    script.chmod(0o755)
    logs_root = request.workdir / log_dir(request.recipe)
    logs_root.mkdir(parents=True, exist_ok=True)
    # Secrets reach the job through sbatch's environment (exported to the job), never a file.
    env = {**os.environ, **request.secrets, WHEEL_ENV: str(_ship_wheel(logs_root))}
    proc = run_slurm(["sbatch", "--parsable", str(script)], env=env, cwd=request.workdir)
    job_id = proc.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise RlxError(f"sbatch answered {proc.stdout.strip()!r}, not a job id")
    token = request.secrets.get(RAY_TOKEN_SECRET)
    if token:
        save_token(request.workdir, request.name, token)  # for rlx attach and -b ray
    return request.job(
        BACKEND.name, job_id, str(script), logs=str(logs_root / f"{request.name}-{job_id}")
    )


def _ship_wheel(logs_root: Path) -> Path:
    """rlx ships itself: a wheel of the running rlx in the jobs' log folder, which every
    node reads (it is where Slurm writes the job's output). Named by version, so a wheel
    already there is the same one."""
    from rlx.launchers.ship import build_wheel, wheel_dir

    wheel = build_wheel(wheel_dir(os.environ))
    shipped = logs_root.resolve() / ".rlx-wheels" / wheel.name
    if not shipped.exists():
        shipped.parent.mkdir(parents=True, exist_ok=True)
        partial = shipped.with_suffix(f".{os.getpid()}.tmp")
        shutil.copyfile(wheel, partial)
        partial.replace(shipped)
    return shipped


# The states in which a job holds its nodes (a PENDING one waits in the queue, holding none).
HOLDING = ("CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED")


def status(job: Job) -> JobStatus:
    state, code, reason = job_state(job)
    shown = STATE_NAMES.get(state, "FAILED" if state in TERMINAL else state)
    if state == "COMPLETED" and code not in (None, 0):
        shown = "FAILED"
    detail = ", ".join(
        x
        for x in (
            state.lower(),
            reason,
            _progress(job),
            f"exit code {code}" if code is not None else "",
        )
        if x
    )
    return JobStatus(job.name, BACKEND.name, shown, detail, code, up=state in HOLDING)


def _progress(job: Job) -> str:
    """Training progress when the run folder the head names is on this machine's
    filesystem (Slurm's logging folder is usually shared)."""
    from rlx.runs import progress_detail, run_dir_from_log

    head = attempt_folder(job) / "head.log"
    try:
        run_dir = run_dir_from_log(head.read_text(errors="replace"))
    except OSError:
        return ""
    return (progress_detail(run_dir) or "") if run_dir else ""


def _log_files(job: Job, node: int | None) -> list[Path]:
    folder = attempt_folder(job)
    if node is None or node == 0:
        return [folder / "head.log"]
    hosts = job_hosts(folder)
    if not 0 < node < len(hosts):
        raise RlxError(f"node {node} is not in job {job.name} (nodes 0..{max(len(hosts) - 1, 0)})")
    return [folder / f"worker-{hosts[node]}.log"]


def logs(job: Job, *, follow: bool, node: int | None) -> int:
    files = _log_files(job, node)
    offsets = dict.fromkeys(files, 0)

    def drain() -> None:
        for path in files:
            if path.exists():
                with path.open("rb") as f:
                    f.seek(offsets[path])
                    chunk = f.read()
                offsets[path] += len(chunk)
                sys.stdout.write(chunk.decode(errors="replace"))
        sys.stdout.flush()

    drain()
    if follow:
        while job_state(job)[0] not in (*TERMINAL, "UNKNOWN"):
            time.sleep(1.0)
            drain()
        drain()  # what arrived while the job finished
    if not any(path.exists() for path in files):
        raise RlxError(
            f"no log yet at {files[0]} (the job may still be pending: rlx status {job.name})"
        )
    return 0


def down(job: Job) -> None:
    run_slurm(["scancel", job.handle])
    for _ in range(120):  # wait until the controller has let go of it
        if job_state(job)[0] not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            return
        time.sleep(0.5)


def attach(job: Job, node: int, command: list[str]) -> int:
    """A shell (or `command`) on node `node` of the running job, inside its container."""
    from rlx.launchers.slurm.attach import attach as attach_step

    recipe = job.launched_recipe()
    port = (recipe.ray if recipe else RaySettings()).port
    flags, prefix = attach_container(recipe, job.handle)
    return attach_step(job, node, command, port, flags, prefix)


def tunnel(job: Job, local_port: int) -> None:
    """Forward a local port to the head's dashboard through srun, until Ctrl-C."""
    from rlx.launchers.slurm.attach import tunnel as tunnel_step

    recipe = job.launched_recipe()
    remote = (recipe.ray if recipe else RaySettings()).dashboard_port
    tunnel_step(job, local_port, remote, *attach_container(recipe, job.handle))
