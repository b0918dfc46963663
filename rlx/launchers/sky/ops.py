"""Operate SkyPilot jobs through its Python SDK: launch, status, logs, down.

SkyPilot (0.10+) is client-server: every SDK call returns a request id that is waited on with
`sky.get` / `sky.stream_and_get`, and with no server configured the SDK starts a local API
server, as `sky launch` does. Secret values go to SkyPilot as task secrets: rlx writes them
nowhere, but SkyPilot's API server keeps each request it runs (the task, secrets included) in
its own requests database. SkyPilot's errors become one line naming the cause and the next step.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterable, Iterator
from contextlib import suppress
from typing import Any, TextIO

import yaml

from rlx.errors import RlxError
from rlx.launchers.base import Job, JobStatus, LaunchRequest, remember
from rlx.launchers.common import ENDED_IDLE_MINUTES
from rlx.launchers.ops_common import absolute_local, one_line, save_rendered
from rlx.launchers.ship import build_wheel, wheel_dir
from rlx.launchers.sky import BACKEND
from rlx.launchers.sky.errors import ERRORS, Target
from rlx.node.env import WHEEL_ENV
from rlx.recipe.model import is_bucket

MANAGED = "managed"  # Job.extra key: "1" for a managed job (handle = managed job id)
JOB_ID = "job_id"  # Job.extra key: the job's id on its cluster


def _sky() -> Any:
    try:
        import sky
    except ImportError:
        raise RlxError(
            "SkyPilot is not installed; install it with: pip install 'rlx[sky]'"
        ) from None
    return sky


# ------------------------------------------------------------------------- launch


def launch_config(request: LaunchRequest) -> dict[str, Any]:
    """The rendered task as a dict, with local paths made absolute against the launch
    folder (the rendered file keeps them as the recipe wrote them)."""
    return _for_launch(
        yaml.safe_load(request.rendered), request, build_wheel(wheel_dir(os.environ))
    )


def _for_launch(config: dict[str, Any], request: LaunchRequest, wheel: Any) -> dict[str, Any]:
    if isinstance(config.get("workdir"), str):
        config["workdir"] = absolute_local(config["workdir"], request.workdir)
    for remote, source in dict(config.get("file_mounts") or {}).items():
        if isinstance(source, str) and not is_bucket(source):
            config["file_mounts"][remote] = absolute_local(source, request.workdir)
    # rlx ships itself: the node installs this wheel when its own rlx differs.
    remote = f"~/.rlx/wheels/{wheel.name}"
    config.setdefault("file_mounts", {})[remote] = str(wheel)
    config.setdefault("envs", {})[WHEEL_ENV] = remote
    return config


def job_group_text(request: LaunchRequest) -> str:
    """The rendered job group (resources.groups) with each job prepared as launch_config
    prepares a task: the text SkyPilot's job-group loader reads."""
    header, *jobs = yaml.safe_load_all(request.rendered)
    wheel = build_wheel(wheel_dir(os.environ))
    prepared = [_for_launch(job, request, wheel) for job in jobs]
    return yaml.safe_dump_all([header, *prepared], sort_keys=False)


def _launch_job_group(sky: Any, request: LaunchRequest, rendered_file: str) -> Job:
    """SkyPilot runs a job group only as a managed job: one cluster per group."""
    from sky.utils import dag_utils

    target = Target(request.name, managed=True)
    with ERRORS.around(target):
        dag = dag_utils.load_job_group_from_yaml_str(
            job_group_text(request), secrets_overrides=list(request.secrets.items())
        )
        job_ids, _ = sky.stream_and_get(sky.jobs.launch(dag, name=request.name))
    if not job_ids:
        raise RlxError(f"SkyPilot accepted {request.name} but returned no managed job id")
    job = request.job(BACKEND.name, str(job_ids[0]), rendered_file)
    job.extra[MANAGED] = "1"
    return job


def launch(request: LaunchRequest) -> Job:
    sky = _sky()
    rendered_file = save_rendered(request, BACKEND.suffix)
    if request.recipe.resources.groups is not None:
        return _launch_job_group(sky, request, str(rendered_file))
    target = Target(request.name, managed=request.managed)
    with ERRORS.around(target):
        # Values are merged in before the task is built: a secret left without a value
        # becomes a reference to SkyPilot's managed secrets, which a plain server refuses.
        task = sky.Task.from_yaml_config(
            launch_config(request), secrets_overrides=list(request.secrets.items())
        )
    job = request.job(BACKEND.name, request.name, str(rendered_file))
    if request.managed:
        with ERRORS.around(target):
            job_ids, _ = sky.stream_and_get(sky.jobs.launch(task, name=request.name))
        if not job_ids:
            raise RlxError(f"SkyPilot accepted {request.name} but returned no managed job id")
        job.handle = str(job_ids[0])
        job.extra[MANAGED] = "1"
        return job
    try:
        with ERRORS.around(target):
            # Down when the job ends, as the task's own autostop says (a kept cluster's
            # head holds the job until its idle limit).
            launched = sky.launch(
                task,
                cluster_name=request.name,
                down=True,
                idle_minutes_to_autostop=ENDED_IDLE_MINUTES,
            )
            job_id, _ = sky.stream_and_get(launched)
    except RlxError:
        # A cluster that got as far as existing must stay reachable by `rlx down`.
        if _cluster_exists(sky, request.name):
            remember(job, request.workdir)
        raise
    if job_id is not None:
        job.extra[JOB_ID] = str(job_id)
    return job


def _cluster_exists(sky: Any, cluster: str) -> bool:
    with suppress(Exception):
        return bool(sky.get(sky.status([cluster], all_users=True)))
    return False


def _target(job: Job) -> Target:
    return Target(job.handle, managed=bool(job.extra.get(MANAGED)))


# ------------------------------------------------------------------------- status

# SkyPilot's job states (cluster jobs and managed jobs) -> rlx's.
STATES = {
    "INIT": "PENDING",
    "PENDING": "PENDING",
    "SUBMITTED": "PENDING",
    "STARTING": "PENDING",
    "SETTING_UP": "PENDING",
    "RUNNING": "RUNNING",
    "RECOVERING": "RUNNING",
    "WINDING_DOWN": "RUNNING",
    "CANCELLING": "RUNNING",
    "SUCCEEDED": "SUCCEEDED",
    "CANCELLED": "CANCELLED",
}


def state_name(value: Any) -> str:
    """Name of a SkyPilot status enum (or string), e.g. 'FAILED_SETUP'."""
    return str(getattr(value, "value", value) or "UNKNOWN")


def rlx_state(sky_state: str) -> str:
    if sky_state in STATES:
        return STATES[sky_state]
    return "FAILED" if sky_state.startswith("FAILED") else "UNKNOWN"


def status(job: Job) -> JobStatus:
    sky = _sky()
    target = _target(job)
    with ERRORS.around(target):
        if target.managed:
            return _managed_status(sky, job)
        return _cluster_status(sky, job)


def _managed_status(sky: Any, job: Job) -> JobStatus:
    try:
        request_id = sky.jobs.queue_v2(refresh=False, job_ids=[int(job.handle)], all_users=True)
        answer = sky.get(request_id)
    except sky.exceptions.ClusterNotUpError:
        # No controller means no managed job in progress: an answer, not an error.
        detail = "jobs controller not up (no managed job in progress; see `sky jobs queue`)"
        return JobStatus(job.name, BACKEND.name, "UNKNOWN", detail)
    records = answer[0] if isinstance(answer, tuple) else answer
    if not records:
        detail = f"no managed job {job.handle} (see `sky jobs queue`)"
        return JobStatus(job.name, BACKEND.name, "UNKNOWN", detail)
    record = records[0]
    state = state_name(record["status"])
    reason = record.get("failure_reason") or record.get("details") or ""
    detail = f"managed job {state.lower()}" + (f": {one_line(reason)}" if reason else "")
    return JobStatus(job.name, BACKEND.name, rlx_state(state), detail)


def _cluster_status(sky: Any, job: Job) -> JobStatus:
    # Up (billed) while the cluster is, whatever its job's state: done, it still holds the
    # nodes until autostop takes it down.
    records = sky.get(sky.status([job.handle], all_users=True))
    if not records:
        detail = f"no cluster {job.handle} (torn down?)"
        return JobStatus(job.name, BACKEND.name, "UNKNOWN", detail, up=False)
    cluster = state_name(records[0]["status"])
    if cluster == "INIT":
        return JobStatus(
            job.name, BACKEND.name, "PENDING", "cluster INIT (provisioning or unhealthy)", up=True
        )
    if cluster != "UP":  # STOPPED: its disks are all that is left
        return JobStatus(job.name, BACKEND.name, "UNKNOWN", f"cluster {cluster.lower()}", up=False)
    job_id = int(job.extra[JOB_ID]) if job.extra.get(JOB_ID) else None
    answer = sky.get(sky.job_status(job.handle, [job_id] if job_id is not None else None))
    state = state_name(next(iter(answer.values()), None) if answer else None)
    got = launched(records[0])
    detail = f"cluster up, job {state.lower()}" + (f"; {got}" if got else "")
    return JobStatus(job.name, BACKEND.name, rlx_state(state), detail, up=True)


def launched(record: Any) -> str:
    """What the cluster got, from its status record (no further call): the accelerators, spot
    or on-demand, and cloud/region, e.g. 'H100:8 spot on aws/us-east-1'; '' if it says none."""
    resources = getattr(_field(record, "handle"), "launched_resources", None)
    accelerators = getattr(resources, "accelerators", None) or {}
    spot = getattr(resources, "use_spot", None)
    cloud = getattr(resources, "cloud", None) or _field(record, "cloud")
    region = getattr(resources, "region", None) or _field(record, "region")
    parts = [
        ", ".join(f"{name}:{count:g}" for name, count in accelerators.items()),
        "" if spot is None else "spot" if spot else "on-demand",
        "on " + "/".join(str(p).lower() for p in (cloud, region) if p) if cloud else "",
    ]
    return " ".join(part for part in parts if part)


def _field(record: Any, key: str) -> Any:
    # SkyPilot's status records are dicts or response models, by version
    try:
        return record[key]
    except (KeyError, TypeError, AttributeError):
        return getattr(record, key, None)


# ------------------------------------------------------------------------- logs

# SkyPilot prefixes every line of a multi-node run with its node: "(head, rank=0, pid=42) "
# or "(worker1, rank=1, pid=42, ip=10.0.0.2) ", possibly in colour.
NODE_PREFIX = re.compile(r"^(?:\x1b\[[0-9;]*m)*\((?:head|worker\d+), rank=(\d+), pid=")


def node_lines(lines: Iterable[str], node: int) -> Iterator[str]:
    """Only the lines SkyPilot tagged as coming from node `node` (its SKYPILOT_NODE_RANK)."""
    for line in lines:
        found = NODE_PREFIX.match(line)
        if found and int(found.group(1)) == node:
            yield line


class NodeFilter:
    """A text sink for SkyPilot's log streaming that passes on one node's lines only."""

    def __init__(self, node: int, out: TextIO) -> None:
        self.node = node
        self.out = out
        self.pending = ""
        self.shown = 0

    def write(self, text: str) -> int:
        self.pending += text
        *complete, self.pending = self.pending.split("\n")
        for line in node_lines(complete, self.node):
            self.out.write(line + "\n")
            self.shown += 1
        return len(text)

    def flush(self) -> None:
        self.out.flush()


def logs(job: Job, *, follow: bool, node: int | None) -> int:
    sky = _sky()
    target = _target(job)
    sink = NodeFilter(node, sys.stdout) if node is not None else None
    job_id = job.extra.get(JOB_ID)
    with ERRORS.around(target):
        if target.managed:
            code = sky.jobs.tail_logs(job_id=int(job.handle), follow=follow, output_stream=sink)
        else:
            code = sky.tail_logs(
                job.handle, int(job_id) if job_id else None, follow, output_stream=sink
            )
    if sink is not None:
        sink.write("\n")  # a last line without its newline
        if not sink.shown:
            print(
                f"rlx: no lines from node {node} (SkyPilot tags each line of a multi-node "
                "run with its node's rank)",
                file=sys.stderr,
            )
    return int(code or 0)


# ------------------------------------------------------------------------- down


def down(job: Job) -> None:
    sky = _sky()
    target = _target(job)
    with ERRORS.around(target):
        if target.managed:
            sky.get(sky.jobs.cancel(job_ids=[int(job.handle)]))
        else:
            sky.stream_and_get(sky.down(job.handle))
