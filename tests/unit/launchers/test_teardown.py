"""What stays up once a job ends, and for how long a job may run or wait to start, as each
backend's own loader reads the rendering: SkyPilot's autostop (down) and managed recovery on
rlx's exit 75, dstack's fleet with its idle_duration and the run's max_duration and retry,
Slurm's --time and --deadline; a kept cluster's idle limit; the one line the Ray Jobs and
local backends say."""

from __future__ import annotations

from pathlib import Path
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
