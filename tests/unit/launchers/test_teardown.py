"""What stays up once a job ends, and for how long a job may run or wait to start, as each
backend's own loader reads the rendering: SkyPilot's autostop (down) and managed recovery on
rlx's exit 75, dstack's fleet with its idle_duration and the run's max_duration and retry,
Slurm's --time and --deadline; a kept cluster's idle limit; the one line the Ray Jobs and
local backends say."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from rlx.errors import TRY_AGAIN
from rlx.launchers import render
from rlx.launchers.base import LaunchRequest
from rlx.launchers.common import ENDED_IDLE_MINUTES
from rlx.recipe import load_recipe
from rlx.recipe.load import parse_recipe
from tests.conftest import RECIPES, REPO

LIMITS = REPO / "tests" / "recipes" / "limits.yaml"
SINGLE = [
    p for p in sorted(RECIPES.glob("*.yaml")) if load_recipe(p).recipe.resources.groups is None
]


def recipe(text: str):
    return parse_recipe(text, "job.yaml").recipe


def sky_task(job: Any) -> Any:
    sky = pytest.importorskip("sky")
    return sky.Task.from_yaml_config(yaml.safe_load(render("sky", job, "job.yaml")))


# ------------------------------------------------------------------------- SkyPilot


@pytest.mark.parametrize("path", [*SINGLE, LIMITS], ids=lambda p: p.stem)
def test_skypilot_tears_the_cluster_down_when_the_job_ends(path: Path):
    from sky.skylet.autostop_lib import AutostopWaitFor

    task = sky_task(load_recipe(path).recipe)
    for resources in task.resources:
        autostop = resources.autostop_config
        assert autostop is not None and autostop.enabled and autostop.down
        assert autostop.idle_minutes == ENDED_IDLE_MINUTES
        # an ssh session left open does not hold the cluster
        assert autostop.wait_for is AutostopWaitFor.JOBS


@pytest.mark.parametrize("path", [*SINGLE, LIMITS], ids=lambda p: p.stem)
def test_managed_recovery_takes_exit_75_as_a_recovery(path: Path):
    loaded = load_recipe(path).recipe
    task = sky_task(loaded)
    wanted = loaded.sky.recovery if loaded.sky else None
    for resources in task.resources:
        recovery = resources.job_recovery
        assert recovery["recover_on_exit_codes"] == [TRY_AGAIN] == [75]
        if wanted is not None:
            assert recovery["strategy"] == wanted.strategy
            assert recovery["max_restarts_on_errors"] == wanted.max_restarts_on_errors


def test_the_job_group_loader_reads_autostop_and_recovery():
    pytest.importorskip("sky")
    from sky.utils import dag_utils

    path = RECIPES / "grpo-async.yaml"
    dag = dag_utils.load_job_group_from_yaml_str(render("sky", load_recipe(path).recipe, "x"))
    for task in dag.tasks:
        for resources in task.resources:
            assert resources.autostop_config.down
            assert resources.job_recovery["recover_on_exit_codes"] == [75]


def test_skypilot_refuses_an_exit_code_it_cannot_have():
    """The loader checks the field (so the test above could fail): codes are 0-255."""
    sky = pytest.importorskip("sky")
    config = yaml.safe_load(render("sky", load_recipe(LIMITS).recipe, "x"))
    config["resources"]["job_recovery"]["recover_on_exit_codes"] = [300]
    with pytest.raises(Exception, match="recover_on_exit_codes"):
        sky.Task.from_yaml_config(config)


def test_a_kept_cluster_holds_with_its_idle_limit_and_then_goes_down():
    """--keep: SkyPilot's loader reads the same autostop (down), and the head's command is
    the hold with the recipe's idle limit, which ends the job and so the cluster."""
    from rlx.launchers.keep import HOLD_COMMAND, kept_recipe
    from rlx.node.env import RECIPE_ENV, recipe_from_env

    task = sky_task(kept_recipe(load_recipe(LIMITS).recipe))
    (resources,) = task.resources
    assert resources.autostop_config.down
    on_nodes = recipe_from_env(task.envs)
    assert on_nodes.head_command == [HOLD_COMMAND] and on_nodes.resources.idle_minutes == 20
    assert RECIPE_ENV in task.envs


def test_a_start_deadline_is_kubernetes_provision_timeout():
    deadline = "name: job\ncommand: [echo]\nresources:\n  start_deadline: 20m\n"
    on_k8s = sky_task(recipe(deadline + "  infra: [k8s, aws]\n"))
    for resources in on_k8s.resources:
        assert resources.cluster_config_overrides == {"kubernetes": {"provision_timeout": 1200}}
    anywhere = sky_task(recipe(deadline))
    assert all(r.cluster_config_overrides for r in anywhere.resources)
    # on clouds SkyPilot tries each place once and gives up: nothing to set
    on_aws = sky_task(recipe(deadline + "  infra: aws\n"))
    assert not any(r.cluster_config_overrides for r in on_aws.resources)


class FakeSky:
    """What rlx's SkyPilot launch calls, recording the launch's arguments."""

    def __init__(self) -> None:
        sky = pytest.importorskip("sky")
        self.Task = sky.Task
        self.launched: dict[str, Any] = {}

    def launch(self, task: Any, **kwargs: Any) -> str:
        self.launched = {"task": task, **kwargs}
        return "request"

    def stream_and_get(self, request: str) -> tuple[int, None]:
        return 1, None


def test_the_launch_call_tears_down_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from rlx.launchers.sky import ops

    fake = FakeSky()
    monkeypatch.setattr(ops, "_sky", lambda: fake)
    monkeypatch.setattr(ops, "build_wheel", lambda _: tmp_path / "rlx-0-py3-none-any.whl")
    job = recipe("name: job\ncommand: [echo]\n")
    request = LaunchRequest(
        recipe=job,
        source="job.yaml",
        name="job",
        rendered=render("sky", job, "job.yaml"),
        secrets={},
        workdir=tmp_path,
    )
    launched = ops.launch(request)
    assert launched.extra["job_id"] == "1"
    assert fake.launched["down"] is True
    assert fake.launched["idle_minutes_to_autostop"] == ENDED_IDLE_MINUTES
    (resources,) = fake.launched["task"].resources
    assert resources.autostop_config.down


# ------------------------------------------------------------------------- dstack


def dstack_documents(job: Any) -> tuple[Any, Any]:
    """(fleet or None, task) of a dstack rendering, each parsed as `dstack apply` parses."""
    pytest.importorskip("dstack")
    from dstack._internal.core.models.configurations import (
        parse_apply_configuration,
        parse_run_configuration,
    )

    documents = list(yaml.safe_load_all(render("dstack", job, "job.yaml")))
    assert len(documents) in (1, 2)
    task = parse_run_configuration(documents[-1])
    fleet = parse_apply_configuration(documents[0]) if len(documents) == 2 else None
    return fleet, task


ALL = [*sorted(RECIPES.glob("*.yaml")), LIMITS]


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.stem)
def test_dstack_runs_in_a_fleet_whose_instances_go_when_idle(path: Path):
    loaded = load_recipe(path).recipe
    fleet, task = dstack_documents(loaded)
    idle = ENDED_IDLE_MINUTES * 60
    assert task.idle_duration == idle  # what the run provisions, in any fleet
    named = loaded.dstack.fleets if loaded.dstack else []
    if named:
        assert fleet is None and [f.name for f in task.fleets] == named
        return
    # its own fleet, named after the job: none kept, at most the job's nodes, one cluster
    assert fleet.type == "fleet" and fleet.name == loaded.name
    assert [f.name for f in task.fleets] == [loaded.name]
    assert (fleet.nodes.min, fleet.nodes.max) == (0, loaded.resources.total_nodes)
    assert fleet.placement.value == "cluster"
    assert fleet.idle_duration == idle
    assert fleet.spot_policy == task.spot_policy and fleet.backends == task.backends


def test_dstack_max_duration_and_start_deadline():
    _, task = dstack_documents(load_recipe(LIMITS).recipe)
    assert task.max_duration == 12 * 3600
    assert task.retry.duration == 45 * 60
    assert [e.value for e in task.retry.on_events] == ["no-capacity"]
    # a start deadline beside dstack's own retry events: the events stay, the duration is it
    job = recipe(
        "name: job\ncommand: [echo]\nresources:\n  start_deadline: 2h\n"
        "dstack:\n  retry: {on_events: [no-capacity, interruption]}\n"
    )
    _, task = dstack_documents(job)
    assert task.retry.duration == 7200
    assert [e.value for e in task.retry.on_events] == ["no-capacity", "interruption"]


@pytest.mark.parametrize(
    "lines,says",
    [
        (
            "resources: {max_duration: 8h}\ndstack: {max_duration: 4h}\n",
            "dstack.max_duration: resources.max_duration sets dstack's max_duration too",
        ),
        (
            "resources: {start_deadline: 1h}\ndstack: {retry: {duration: 3h}}\n",
            "dstack.retry.duration: resources.start_deadline sets dstack's retry duration",
        ),
        (
            "resources: {start_deadline: 1h}\ndstack: {retry: {on_events: [interruption]}}\n",
            "dstack.retry.on_events: resources.start_deadline is how long dstack retries",
        ),
    ],
    ids=["max-duration-twice", "retry-duration-twice", "no-capacity-left-out"],
)
def test_dstack_refuses_a_limit_said_twice(lines: str, says: str, write_recipe):
    from typer.testing import CliRunner

    from rlx.cli import app
    from rlx.errors import RlxError
    from tests.support.cli import assert_one_line_error

    # refused when rendered, lint or not, in lint's words
    with pytest.raises(RlxError) as refused:
        render("dstack", recipe(f"name: job\ncommand: [echo]\n{lines}"), "job.yaml")
    assert str(refused.value).startswith(says) and "\n" not in str(refused.value)
    path = write_recipe(f"name: job\ncommand: [echo]\n{lines}")
    result = CliRunner().invoke(app, ["render", str(path), "-b", "dstack"])
    assert f"{path}:" in result.output and says in result.output
    assert_one_line_error(result, "1 lint error(s)")


class FakeFleets:
    """dstack's fleets API as rlx's launch uses it: a plan for a spec, and applying it."""

    def __init__(self, current: Any = None, action: str = "create", same: bool = False):
        self.current, self.action, self.same = current, action, same
        self.applied: list[Any] = []

    def get_plan(self, project: str, spec: Any) -> Any:
        effective = spec if not self.same else None

        class Plan:
            current_resource = self.current
            action = self.action

            def get_effective_spec(plan) -> Any:
                return spec if effective is not None else self.current.spec

        return Plan()

    def apply_plan(self, project: str, plan: Any) -> None:
        self.applied.append(plan)


@pytest.mark.parametrize(
    "current,action,same,applied,refused",
    [
        (None, "create", False, True, False),  # no fleet yet: created
        ("old", "update", False, True, False),  # changed in place
        ("old", "create", True, False, False),  # as it is: left alone
        ("old", "create", False, False, True),  # cannot change in place: the user's call
    ],
    ids=["create", "update", "unchanged", "recreate"],
)
def test_launch_applies_the_jobs_own_fleet(
    tmp_path: Path, current: Any, action: str, same: bool, applied: bool, refused: bool
):
    pytest.importorskip("dstack")
    from rlx.errors import RlxError
    from rlx.launchers.dstack.errors import Target
    from rlx.launchers.dstack.ops import apply_fleet, fleet_configuration

    job = load_recipe(LIMITS).recipe
    request = LaunchRequest(job, "x", "limits", render("dstack", job, "x"), {}, tmp_path)
    fleet = fleet_configuration(request)
    existing = None if current is None else SimpleNamespace(spec=object())
    fleets = FakeFleets(existing, action, same)
    client = SimpleNamespace(client=SimpleNamespace(fleets=fleets))
    if refused:
        with pytest.raises(RlxError, match="fleet limits exists with settings that cannot"):
            apply_fleet(client, Target("limits", "main"), fleet)
    else:
        apply_fleet(client, Target("limits", "main"), fleet)
    assert bool(fleets.applied) == applied


def test_no_offer_in_the_jobs_own_fleet_is_said_as_such():
    from rlx.launchers.dstack.ops import NO_CAPACITY, NodeJob, RunView, verdict

    said = "no offers"
    jobs = (NodeJob(0, "failed", NO_CAPACITY, said), NodeJob(1, "failed", NO_CAPACITY, said))
    run = RunView("limits", "failed", "job_failed", 2, ("limits",), jobs)
    state = verdict(run)
    assert state.state == "FAILED"
    assert state.detail.startswith("dstack: no offer can run this 2-node job in its fleet limits")
    assert "dstack offer" in state.detail


# ------------------------------------------------------------------------- Slurm


def sbatch_lines(job: Any) -> list[str]:
    return [line for line in render("slurm", job, "job.yaml").splitlines() if line[:7] == "#SBATCH"]


def test_slurm_time_limit_and_start_deadline():
    lines = sbatch_lines(load_recipe(LIMITS).recipe)
    assert "#SBATCH --time=12:00:00" in lines
    # Slurm drops a job that cannot end before its deadline: 45 minutes to start + 12 hours
    assert "#SBATCH --deadline=now+765minutes" in lines
    job = recipe(
        "name: job\ncommand: [echo]\nresources:\n  start_deadline: 90s\nslurm:\n  time: 1-12:30\n"
    )
    lines = sbatch_lines(job)
    assert "#SBATCH --time=1-12:30" in lines
    assert f"#SBATCH --deadline=now+{90 + 36 * 3600 + 30 * 60}" in lines
    longer = recipe("name: job\ncommand: [echo]\nresources:\n  max_duration: 3d\n")
    assert "#SBATCH --time=3-00:00:00" in sbatch_lines(longer)


def test_every_component_of_a_heterogeneous_job_has_the_time_limit():
    text = (RECIPES / "grpo-async.yaml").read_text()
    job = parse_recipe(
        text.replace('time: "12:00:00"', "").replace(
            "resources:", "resources:\n  max_duration: 6h", 1
        )
    ).recipe
    lines = sbatch_lines(job)
    assert lines.count("#SBATCH --time=06:00:00") == 2


@pytest.mark.parametrize(
    "lines,says",
    [
        (
            "resources: {start_deadline: 1h}\n",
            "resources.start_deadline: Slurm's --deadline drops a job that cannot end before it",
        ),
        (
            "resources: {max_duration: 8h}\nslurm: {time: '04:00:00'}\n",
            "slurm.time: resources.max_duration sets Slurm's --time too",
        ),
    ],
    ids=["deadline-without-time", "time-twice"],
)
def test_slurm_refuses_a_deadline_it_cannot_keep(lines: str, says: str):
    from rlx.errors import RlxError

    with pytest.raises(RlxError) as refused:
        render("slurm", recipe(f"name: job\ncommand: [echo]\n{lines}"), "job.yaml")
    assert str(refused.value).startswith(says)


def test_slurm_lint_on_deadlines(write_recipe):
    from rlx.lint import lint_file

    def found(text: str) -> dict[tuple[str, str], str]:
        path = write_recipe(f"name: job\ncommand: [echo]\n{text}")
        return {(f.field, f.severity): f.message for f in lint_file(path)}

    # for the clouds a recipe also runs on: a warning with a slurm section, refused on Slurm
    assert ("resources.start_deadline", "warning") in found(
        "resources: {start_deadline: 1h}\nslurm: {partition: gpu}\n"
    )
    requeued = found(
        "resources: {start_deadline: 1h, max_duration: 8h}\nslurm: {requeue: {retries: 2}}\n"
    )
    assert requeued[("resources.start_deadline", "warning")].startswith(
        "Slurm keeps a job's --deadline when it requeues it"
    )
    assert ("slurm.time", "error") in found(
        "resources: {max_duration: 8h}\nslurm: {time: '04:00:00'}\n"
    )


# ------------------------------------------------------------------------- lint


def test_lint_says_skypilot_keeps_no_time_limit():
    from rlx.lint import lint_file

    findings = [f for f in lint_file(LIMITS) if f.field == "resources.max_duration"]
    assert [(f.severity, f.message.split(":")[0]) for f in findings] == [
        ("warning", "SkyPilot has no run time limit")
    ]


# ------------------------------------------------------------------------- Ray Jobs, local


def test_ray_jobs_and_local_say_what_stays_up(write_recipe):
    from typer.testing import CliRunner

    from rlx.cli import app

    runner = CliRunner()
    path = RECIPES / "quickstart.yaml"
    local = runner.invoke(app, ["launch", str(path), "--dry-run"])
    assert local.exit_code == 0, local.output
    assert "# nothing stays up after this run: its Ray and every process it starts end" in (
        local.stdout
    )
    header = json.loads(runner.invoke(app, ["render", str(path), "-b", "ray"]).stdout)
    assert any("The cluster this job runs on stays up after it" in c for c in header["_comment"])
    # `rlx launch -b ray` says it before it submits (here it then stops: no address)
    command = write_recipe("name: job\ncommand: [echo hi]\nray: {auth: none}\n")
    ray = runner.invoke(app, ["launch", str(command), "-b", "ray"], env={"RAY_ADDRESS": ""})
    assert ray.exit_code == 1
    assert "rlx: the cluster this job runs on stays up after it" in ray.stderr


@pytest.mark.parametrize("backend", ["ray", "local"])
def test_an_idle_limit_where_nothing_is_kept_is_one_line(backend: str, write_recipe):
    from typer.testing import CliRunner

    from rlx.cli import app
    from tests.support.cli import assert_one_line_error

    path = write_recipe("name: job\ncommand: [echo hi]\nresources:\n  idle_minutes: 10\n")
    args = ["render", str(path), "-b", "ray"] if backend == "ray" else ["launch", str(path)]
    result = CliRunner().invoke(app, [*args, "--dry-run"] if backend == "local" else args)
    assert_one_line_error(result, "resources.idle_minutes: ", "drop it")
    # the default, unsaid, is no promise: fine
    plain = write_recipe("name: job\ncommand: [echo hi]\n", "plain.yaml")
    args = ["render", str(plain), "-b", "ray"] if backend == "ray" else ["launch", str(plain)]
    ok = CliRunner().invoke(app, [*args, "--dry-run"] if backend == "local" else args)
    assert ok.exit_code == 0, ok.output
