"""Submit, follow, report and stop a Ray job through Ray's Jobs API.

The address comes from `--address` or RAY_ADDRESS (the cluster's dashboard, usually through
a tunnel); the token from RAY_AUTH_TOKEN (or RLX_RAY_TOKEN), sent as `Authorization: Bearer`,
which is how Ray >= 2.52's dashboard checks it. Neither the token nor any secret is written
to the job registry.

`rlx launch -b ray` follows the job's log to its end and exits with the job's own outcome:
the driver's exit code (a non-zero exit is never 0, whatever Ray calls the job), 143 for a
stopped job, 1 for a job that failed before its driver ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlx.errors import RlxError
from rlx.launchers.base import Job, JobStatus, LaunchRequest
from rlx.launchers.ops_common import absolute_local, save_rendered
from rlx.launchers.ray import BACKEND
from rlx.launchers.ray.errors import ERRORS, Target
from rlx.launchers.ray.render import submission
from rlx.node.env import RAY_TOKEN_SECRET

TOKEN_ENVS = ("RAY_AUTH_TOKEN", RAY_TOKEN_SECRET)
STOPPED_EXIT = 143  # as a process ended by SIGTERM, which is what stopping sends the driver
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
STATE_NAMES = {"STOPPED": "CANCELLED"}


def resolve_address(address: str | None, env: Mapping[str, str]) -> str:
    """The dashboard's http(s) address from --address or RAY_ADDRESS; one line otherwise."""
    value = (address or env.get("RAY_ADDRESS", "")).strip().rstrip("/")
    if not value:
        raise RlxError(
            "-b ray needs the cluster's dashboard: --address http://HOST:8265 or RAY_ADDRESS "
            "(through the tunnel `rlx launch --keep` printed)"
        )
    if not value.startswith(("http://", "https://")):
        raise RlxError(
            f"--address {value!r}: give the dashboard's URL, e.g. http://127.0.0.1:8265 "
            "(the Jobs API speaks HTTP; ray:// and GCS addresses are for drivers)"
        )
    return value


def token_from(env: Mapping[str, str]) -> str:
    for name in TOKEN_ENVS:
        if env.get(name):
            return env[name]
    return ""


def client(address: str, token: str) -> Any:
    from ray.job_submission import JobSubmissionClient

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with ERRORS.around(Target(address)):
        return JobSubmissionClient(address, headers=headers)


def check_working_dir(path: Path, excludes: list[str]) -> None:
    """Fail before uploading when the folder, after Ray's own excludes (.gitignore,
    .rayignore, runtime_env excludes), is over Ray's upload limit (500 MiB by default)."""
    if not path.is_dir():
        raise RlxError(f"workdir {str(path)!r} is not a folder; fix `workdir` in the recipe")
    from ray._private.runtime_env import packaging

    total = 0

    def add(p: Path) -> None:
        nonlocal total
        if p.is_file():
            total += p.stat().st_size

    include_gitignore = os.environ.get("RAY_RUNTIME_ENV_IGNORE_GITIGNORE", "0") != "1"
    excluded = [packaging._get_excludes(path, excludes)]
    packaging._dir_travel(path, excluded, add, include_gitignore=include_gitignore)
    limit = packaging.GCS_STORAGE_MAX_SIZE
    if total >= limit:
        raise RlxError(
            f"workdir {str(path)!r} holds {total / 2**20:.0f} MiB after Ray's excludes; Ray "
            f"uploads at most {limit / 2**20:.0f} MiB: list big files in a .rayignore there, "
            "or put data and checkpoints on a volume"
        )


def request_kwargs(request: LaunchRequest) -> dict[str, Any]:
    """submit_job's arguments: the rendered request with secret values from the environment
    and the working dir as an absolute local path."""
    kwargs = submission(request.recipe)
    env_vars = kwargs["runtime_env"]["env_vars"]
    for name in request.recipe.secrets:
        env_vars[name] = request.secrets[name]
    if "working_dir" in kwargs["runtime_env"]:
        folder = Path(absolute_local(kwargs["runtime_env"]["working_dir"], request.workdir))
        check_working_dir(folder, kwargs["runtime_env"].get("excludes", []))
        kwargs["runtime_env"]["working_dir"] = str(folder)
    kwargs["submission_id"] = f"rlx-{request.name}-{secrets.token_hex(4)}"
    return kwargs


def launch(request: LaunchRequest) -> Job:
    address = resolve_address(request.address, os.environ)
    token = token_from(os.environ)
    if request.recipe.ray.auth == "token" and not token:
        raise RlxError(
            "no Ray token: export RAY_AUTH_TOKEN with the cluster's token (for a cluster rlx "
            "keeps: export RAY_AUTH_TOKEN=$(cat .rlx/tokens/NAME)), or set ray.auth: none"
        )
    rendered = save_rendered(request, BACKEND.suffix)
    kwargs = request_kwargs(request)
    jobs = client(address, token)
    with ERRORS.around(Target(address)):
        submission_id = jobs.submit_job(**kwargs)
    job = request.job(BACKEND.name, submission_id, str(rendered), address=address)
    print(f"rlx: submitted {submission_id} to {address}", file=sys.stderr, flush=True)
    if request.detach:
        return job
    from rlx.launchers.base import remember

    remember(job, request.workdir)  # so status and down work while this follows the log
    job.extra["exit_code"] = str(follow_job(jobs, job))
    return job


def _job_client(job: Job) -> Any:
    return client(job.extra["address"], token_from(os.environ))


def exit_code(info: Any) -> int | None:
    """The job's own outcome as an exit code; None while it runs."""
    state = str(getattr(info.status, "value", info.status))
    if state not in TERMINAL:
        return None
    if state == "STOPPED":
        return STOPPED_EXIT
    code = info.driver_exit_code
    if code:
        return int(code)
    return 0 if state == "SUCCEEDED" else 1


def follow_job(jobs: Any, job: Job) -> int:
    """Print the job's log as it grows until it ends; its exit code."""
    target = Target(job.extra["address"], job.handle)

    async def tail() -> None:
        async for chunk in jobs.tail_job_logs(job.handle):
            sys.stdout.write(chunk)
            sys.stdout.flush()

    with ERRORS.around(target):
        # A socket closed early is no outcome: the job's state below says how it ended.
        with contextlib.suppress(RuntimeError):
            asyncio.run(tail())
        while True:
            info = jobs.get_job_info(job.handle)
            code = exit_code(info)
            if code is not None:
                break
            time.sleep(1.0)
    state = str(getattr(info.status, "value", info.status))
    print(
        f"rlx: job {job.handle} {state.lower()}"
        + (f" ({info.message})" if info.message else "")
        + f", exit code {code}",
        file=sys.stderr,
        flush=True,
    )
    return code


def status(job: Job) -> JobStatus:
    jobs = _job_client(job)
    with ERRORS.around(Target(job.extra["address"], job.handle)):
        info = jobs.get_job_info(job.handle)
    state = str(getattr(info.status, "value", info.status))
    code = exit_code(info)
    shown = STATE_NAMES.get(state, state)
    if state == "SUCCEEDED" and code:
        shown = "FAILED"
    detail = ", ".join(
        x for x in (info.message or "", f"exit code {code}" if code is not None else "") if x
    )
    return JobStatus(job.name, BACKEND.name, shown, detail, code)


def logs(job: Job, *, follow: bool, node: int | None) -> int:
    if node not in (None, 0):
        raise RlxError("a Ray job has one log (its driver's); leave out --node")
    jobs = _job_client(job)
    if follow:
        return follow_job(jobs, job)
    with ERRORS.around(Target(job.extra["address"], job.handle)):
        sys.stdout.write(jobs.get_job_logs(job.handle))
        sys.stdout.flush()
        return exit_code(jobs.get_job_info(job.handle)) or 0


def down(job: Job) -> None:
    jobs = _job_client(job)
    with ERRORS.around(Target(job.extra["address"], job.handle)):
        jobs.stop_job(job.handle)
        for _ in range(120):
            if exit_code(jobs.get_job_info(job.handle)) is not None:
                return
            time.sleep(0.5)
