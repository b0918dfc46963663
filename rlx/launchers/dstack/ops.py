"""Operate dstack runs through its Python API (`dstack.api.Client`): launch, status, logs, down.

The client is configured the way dstack's own CLI is: DSTACK_SERVER_URL + DSTACK_TOKEN +
DSTACK_PROJECT when set, else the default project of ~/.dstack/config.yml. The rendered run
configuration names secrets without values; `launch` fills them in from the values rlx holds,
as `dstack apply` fills names-only env entries from its own environment. dstack keeps a run's
env (so these values too) in its run spec, in the server's database; rlx writes them nowhere.
"""

from __future__ import annotations

import base64
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from rlx.errors import RlxError
from rlx.launchers.base import Job, JobStatus, LaunchRequest, remember
from rlx.launchers.dstack import BACKEND
from rlx.launchers.dstack.errors import ERRORS, Target, no_capacity
from rlx.launchers.dstack.render import escape, fleet_text, task_text
from rlx.launchers.ops_common import absolute_local, one_line, save_rendered
from rlx.launchers.ship import build_wheel, wheel_dir
from rlx.node.env import WHEEL_ENV

PROJECT = "project"  # Job.extra key: the dstack project the run was submitted to
PLACEMENT_WAIT_S = 180.0  # how long `launch` waits for the server to place a new run
POLL_S = 2.0
NO_CAPACITY = "failed_to_start_due_to_no_capacity"
PLACED = ("provisioning", "pulling", "running", "done")  # a job that got an instance


def _api() -> Any:
    try:
        import dstack.api
    except ImportError:
        raise RlxError(
            "dstack is not installed; install it with: pip install 'rlx[dstack]'"
        ) from None
    return dstack.api


def _client(project: str | None, run: str) -> tuple[Any, Target]:
    api = _api()
    with ERRORS.around(Target(run, project or "")):
        client = api.Client.from_config(project_name=project)
    return client, Target(run, client.project, client.client.base_url)


# ------------------------------------------------------------------------- what a run is doing


@dataclass(frozen=True)
class NodeJob:
    """One node's job (its latest submission), as far as rlx reads it."""

    node: int
    status: str  # dstack JobStatus value: submitted, provisioning, ..., failed, done
    reason: str  # termination reason ("" while it lives)
    message: str  # the server's words on the termination
    exit_status: int | None = None


@dataclass(frozen=True)
class RunView:
    name: str
    status: str  # dstack RunStatus value: pending, submitted, ..., failed, done
    reason: str  # run termination reason
    nodes: int
    fleets: tuple[str, ...]
    jobs: tuple[NodeJob, ...]
    retries_no_capacity: bool = False  # the run's retry policy covers "no capacity"


def _value(field: Any) -> str:
    return str(getattr(field, "value", field) or "")


def _ref(fleet: Any) -> str:
    """A fleet reference as written in a configuration: NAME or PROJECT/NAME."""
    name = getattr(fleet, "name", fleet)
    project = getattr(fleet, "project", None)
    return f"{project}/{name}" if project else str(name)


def view(run: Any) -> RunView:
    """rlx's view of a dstack Run model (replica 0: a task has one job per node)."""
    conf = run.run_spec.configuration
    jobs = []
    for job in run.jobs:
        if job.job_spec.replica_num != 0 or not job.job_submissions:
            continue
        last = job.job_submissions[-1]
        jobs.append(
            NodeJob(
                job.job_spec.job_num,
                _value(last.status),
                _value(last.termination_reason),
                last.termination_reason_message or "",
                last.exit_status,
            )
        )
    return RunView(
        run.run_spec.run_name,
        _value(run.status),
        _value(run.termination_reason),
        # node groups (resources.groups) leave `nodes` unset: nodes_num counts them all
        int(getattr(conf, "nodes_num", None) or getattr(conf, "nodes", 1) or 1),
        tuple(_ref(f) for f in getattr(conf, "fleets", None) or ()),
        tuple(sorted(jobs, key=lambda j: j.node)),
        _retries_on_no_capacity(conf),
    )


RUN_STATES = {
    "pending": "PENDING",
    "submitted": "PENDING",
    "provisioning": "PENDING",
    "running": "RUNNING",
    "done": "SUCCEEDED",
    "failed": "FAILED",
}
# The run states in which it holds instances (submitted and pending ones wait for them).
HOLDING = ("provisioning", "running", "terminating")
ENDED_BY = {  # run termination reason -> rlx state
    "all_jobs_done": "SUCCEEDED",
    "stopped_by_user": "CANCELLED",
    "aborted_by_user": "CANCELLED",
}


def verdict(run: RunView) -> JobStatus:
    """rlx's state of a run, with a detail line that says why when it did not go well."""
    failed = [j for j in run.jobs if j.status in ("failed", "terminating", "terminated", "aborted")]
    no_room = [j for j in failed if j.reason == NO_CAPACITY]
    if no_room and ENDED_BY.get(run.reason) != "CANCELLED":
        said = one_line(no_room[0].message or NO_CAPACITY)
        if run.retries_no_capacity and run.status not in ("terminated", "failed"):
            return JobStatus(
                run.name, BACKEND.name, "PENDING", f"run {run.status}, waiting to retry: {said}"
            )
        said = no_capacity(run.nodes, run.fleets, said, run.name)
        return JobStatus(run.name, BACKEND.name, "FAILED", said)
    if run.status in ("terminating", "terminated"):
        still = "RUNNING" if run.status == "terminating" else "CANCELLED"
        state = ENDED_BY.get(run.reason) or ("FAILED" if run.reason else still)
    else:
        state = RUN_STATES.get(run.status, "UNKNOWN")
    detail = f"run {run.status}" + (f" ({run.reason})" if run.reason else "")
    culprit = next((j for j in failed if j.reason not in ("", "terminated_by_server")), None)
    if culprit is not None and state == "FAILED":
        said = f": {one_line(culprit.message)}" if culprit.message else ""
        detail += f"; node {culprit.node} {culprit.reason}{said}"
    head = next((j for j in run.jobs if j.node == 0), None)
    code = head.exit_status if head is not None else None
    return JobStatus(run.name, BACKEND.name, state, detail, code)


def placed(run: RunView) -> bool:
    return any(j.status in PLACED for j in run.jobs)


# ------------------------------------------------------------------------- launch


def configuration(request: LaunchRequest) -> Any:
    """The rendered run configuration, parsed by dstack, with secret values and absolute
    local paths filled in."""
    from dstack._internal.core.models.configurations import parse_run_configuration

    try:
        conf = parse_run_configuration(task_text(request.rendered))
    except Exception as exc:  # pydantic's ValidationError, or dstack's ConfigurationError
        raise RlxError(f"dstack rejected the rendered configuration: {one_line(exc)}") from exc
    for name, value in request.secrets.items():
        # dstack interpolates ${{ ... }} in env values on the server: escape like plain env.
        conf.env[name] = escape(value)
    for mapping in conf.files:
        mapping.local_path = absolute_local(mapping.local_path, request.workdir)
    # rlx ships itself: the node installs this wheel when its own rlx differs.
    from dstack._internal.core.models.files import FilePathMapping

    wheel = build_wheel(wheel_dir(os.environ))
    remote = f".rlx-wheels/{wheel.name}"  # under the run's working dir
    conf.files.append(FilePathMapping(local_path=str(wheel), path=remote))
    conf.env[WHEEL_ENV] = remote
    return conf


def fleet_configuration(request: LaunchRequest) -> Any:
    """The fleet the rendered file brings, parsed by dstack (None when the recipe names its
    own fleets)."""
    from dstack._internal.core.models.configurations import parse_apply_configuration

    fleet = fleet_text(request.rendered)
    if fleet is None:
        return None
    try:
        return parse_apply_configuration(fleet)
    except Exception as exc:  # dstack's ConfigurationError
        raise RlxError(f"dstack rejected the rendered fleet: {one_line(exc)}") from exc


def apply_fleet(client: Any, target: Target, fleet: Any) -> None:
    """Create the job's fleet, or update it in place; one that cannot change in place is
    left to the user (it may hold instances another run uses). As the run, it takes no
    profile of the user's dstack config: the file says it all."""
    from dstack._internal.core.models.fleets import FleetSpec
    from dstack._internal.core.models.profiles import Profile

    spec = FleetSpec(configuration=fleet, profile=Profile(name="default"))
    plan = client.client.fleets.get_plan(target.project, spec)
    current = plan.current_resource
    if current is not None:
        if current.spec == plan.get_effective_spec():
            return
        if _value(plan.action) != "update":
            raise RlxError(
                f"dstack: fleet {fleet.name} exists with settings that cannot change in "
                f"place; delete it (`dstack fleet delete {fleet.name}`) or launch with --name"
            )
    client.client.fleets.apply_plan(target.project, plan)


def _retries_on_no_capacity(conf: Any) -> bool:
    retry = getattr(conf, "retry", None)
    events = [_value(e) for e in (getattr(retry, "on_events", None) or [])]
    return "no-capacity" in events


def launch(request: LaunchRequest) -> Job:
    from rlx.launchers.common import refuse
    from rlx.launchers.dstack.checks import check_gpu_names

    # lint checks the names only for a recipe with a dstack section; a GPU dstack does not
    # know would match no offer, and the run would wait for one
    refuse(request.recipe, [check_gpu_names])
    conf = configuration(request)
    fleet = fleet_configuration(request)
    rendered_file = save_rendered(request, BACKEND.suffix)
    client, target = _client(None, request.name)
    with ERRORS.around(target):
        if fleet is not None:
            apply_fleet(client, target, fleet)
        plan = client.runs.get_run_plan(conf, configuration_path=str(rendered_file))
        current = plan.current_resource
        if current is not None and not current.status.is_finished():
            raise RlxError(
                f"dstack: run {request.name} is still active in project {target.project}; "
                f"stop it with `rlx down {request.name}` or launch with another --name"
            )
        run = client.runs.apply_plan(plan, reserve_ports=False)
    job = request.job(BACKEND.name, run.name, str(rendered_file), **{PROJECT: target.project})
    # Remembered before waiting, so that `rlx status/logs/down` find it whatever happens next.
    remember(job, request.workdir)
    if not _retries_on_no_capacity(conf):
        _await_placement(client, target)
    return job


def _await_placement(client: Any, target: Target) -> None:
    """Wait until the server has found instances for the run (or refused it): without a
    fleet, a run fails within seconds, and the user should hear it from `rlx launch`."""
    print(
        f"dstack: submitted run {target.run} to project {target.project}; waiting for the "
        "server to place it (Ctrl-C stops waiting, not the run)",
        file=sys.stderr,
    )
    deadline = time.monotonic() + PLACEMENT_WAIT_S
    while True:
        with ERRORS.around(target):
            run = view(client.client.runs.get(target.project, target.run))
        state = verdict(run)
        if state.state in ("FAILED", "CANCELLED"):
            if state.detail.startswith("dstack:"):
                raise RlxError(state.detail)
            raise RlxError(f"dstack: run {target.run} {state.state.lower()}: {state.detail}")
        if placed(run) or state.state == "SUCCEEDED" or time.monotonic() > deadline:
            return
        time.sleep(POLL_S)


# ------------------------------------------------------------------------- status / logs / down


def _run(job: Job) -> tuple[Any, Target, Any]:
    """(client, target, run model); a run the server does not know is an error."""
    client, target = _client(job.extra.get(PROJECT), job.handle)
    with ERRORS.around(target):
        return client, target, client.client.runs.get(target.project, job.handle)


def status(job: Job) -> JobStatus:
    from dstack._internal.core.errors import ResourceNotExistsError

    try:
        _, _, run = _run(job)
    except RlxError as exc:
        if isinstance(exc.__cause__, ResourceNotExistsError):
            detail = f"no run {job.handle} on the server (see `dstack ps -a`)"
            return JobStatus(job.name, BACKEND.name, "UNKNOWN", detail)
        raise
    seen = view(run)
    found = verdict(seen)
    got = provisioned(run)
    detail = found.detail + (f"; {got}" if got and found.detail else got)
    up = seen.status in HOLDING
    return JobStatus(job.name, BACKEND.name, found.state, detail, found.exit_code, up=up)


def provisioned(run: Any) -> str:
    """What the master node got, from the run's own provisioning data (no further call): its
    GPUs, spot or on-demand, backend/region and price, e.g. 'A100:8 spot on aws/us-east-1,
    $14.2/h'; '' before it has an instance."""
    for job in run.jobs:
        if job.job_spec.replica_num == 0 and job.job_spec.job_num == 0 and job.job_submissions:
            data = job.job_submissions[-1].job_provisioning_data
            break
    else:
        return ""
    if data is None:
        return ""
    resources = data.instance_type.resources
    gpus = [gpu.name for gpu in resources.gpus]
    parts = [
        ", ".join(f"{name}:{gpus.count(name)}" for name in dict.fromkeys(gpus)),
        "spot" if resources.spot else "on-demand",
        f"on {_value(data.backend)}/{data.region},",
        f"${data.price:g}/h",
    ]
    return " ".join(part for part in parts if part)


def logs(job: Job, *, follow: bool, node: int | None) -> int:
    from dstack._internal.server.schemas.logs import PollLogsRequest

    client, target, run = _run(job)
    wanted = 0 if node is None else node
    nodes = sorted(j.job_spec.job_num for j in run.jobs if j.job_spec.replica_num == 0)
    if wanted not in nodes:
        raise RlxError(f"node {wanted} is not in run {job.handle} (nodes {_span(nodes)})")
    since: datetime | None = None
    shown = 0
    while True:
        finished = run.status.is_finished()
        submission = next(
            j.job_submissions[-1]
            for j in run.jobs
            if j.job_spec.replica_num == 0 and j.job_spec.job_num == wanted
        )
        token = None
        while True:  # every page the server has now
            request = PollLogsRequest(
                run_name=job.handle,
                job_submission_id=submission.id,
                start_time=since,
                limit=1000,
                next_token=token,
            )
            with ERRORS.around(target):
                page = client.client.logs.poll(target.project, request)
            for event in page.logs:
                _write(base64.b64decode(event.message))
                since, shown = event.timestamp, shown + 1
            sys.stdout.flush()
            token = page.next_token
            if token is None:
                break
        if not follow or finished:
            break
        time.sleep(POLL_S)
        with ERRORS.around(target):
            run = client.client.runs.get(target.project, job.handle)
    if not shown:
        found = verdict(view(run))
        print(f"rlx: no logs from node {wanted} ({found.state}: {found.detail})", file=sys.stderr)
    if follow:
        return 0 if verdict(view(run)).state == "SUCCEEDED" else 1
    return 0


def _write(data: bytes) -> None:
    """Log bytes to stdout as they are (a text-only stdout gets them decoded)."""
    buffer = getattr(sys.stdout, "buffer", None)
    if buffer is not None:
        sys.stdout.flush()
        buffer.write(data)
    else:
        sys.stdout.write(data.decode(errors="replace"))


def _span(nodes: Sequence[int]) -> str:
    return f"{nodes[0]}..{nodes[-1]}" if nodes else "none yet"


def down(job: Job) -> None:
    client, target, run = _run(job)
    if run.status.is_finished():
        return
    with ERRORS.around(target):
        client.client.runs.stop(target.project, [job.handle], False)
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline:
            if client.client.runs.get(target.project, job.handle).status.is_finished():
                return
            time.sleep(1.0)
