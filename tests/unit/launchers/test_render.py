"""Rendered files: byte-for-byte golden files, and accepted by the real backend tools.

Regenerate the golden files only on purpose, then review the diff:
    RLX_UPDATE_GOLDEN=1 python -m pytest tests/unit/launchers/test_render.py
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from rlx.cli import app
from rlx.launchers import render, renderable, spec
from rlx.launchers.dstack.names import gpu_name
from rlx.launchers.dstack.render import task_text
from rlx.recipe import load_recipe
from tests.conftest import RECIPES, REPO

GOLDEN = REPO / "tests" / "golden"
RECIPE_FILES = sorted(RECIPES.glob("*.yaml"))
# Test recipes (tests/recipes/) for what the shipped ones do not show, with the backends each
# renders for: GPU alternatives with spot auto, a price cap and places (Slurm refuses those),
# a set of GPUs that Slurm asks for by node feature, and limits on time and idleness.
ALTERNATIVES = REPO / "tests" / "recipes" / "alternatives.yaml"
ALTERNATIVES_SET = REPO / "tests" / "recipes" / "alternatives-set.yaml"
# Limits on time and idleness: a run time limit, a start deadline, a kept cluster's idle limit.
LIMITS = REPO / "tests" / "recipes" / "limits.yaml"
TEST_CASES = [
    (ALTERNATIVES, "sky"),
    (ALTERNATIVES, "dstack"),
    *((ALTERNATIVES_SET, b) for b in ("sky", "dstack", "slurm")),
    (LIMITS, "sky"),
    (LIMITS, "dstack"),
    (LIMITS, "slurm"),
]
CASES = [(r, b) for r in RECIPE_FILES for b in renderable()] + TEST_CASES
runner = CliRunner()


def rendered(recipe: Path, backend: str) -> str:
    source = str(recipe.relative_to(REPO))
    return render(backend, load_recipe(recipe).recipe, source)


def golden_path(recipe: Path, backend: str) -> Path:
    return GOLDEN / f"{recipe.stem}{spec(backend).suffix}"


@pytest.mark.parametrize("recipe,backend", CASES, ids=lambda v: getattr(v, "stem", v))
def test_matches_golden(recipe: Path, backend: str):
    text = rendered(recipe, backend)
    path = golden_path(recipe, backend)
    if os.environ.get("RLX_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_text(text, encoding="utf-8")
    assert path.exists(), f"no golden file {path}; create it with RLX_UPDATE_GOLDEN=1"
    assert text == path.read_text(encoding="utf-8"), (
        f"{path.name} differs from the rendering; if the change is intended, regenerate with "
        "RLX_UPDATE_GOLDEN=1 and review the diff"
    )


def test_render_is_deterministic():
    for recipe, backend in CASES:
        assert rendered(recipe, backend) == rendered(recipe, backend)


GROUPED = [r for r in RECIPE_FILES if load_recipe(r).recipe.resources.groups is not None]
SINGLE = [r for r in RECIPE_FILES if r not in GROUPED]


@pytest.mark.parametrize("recipe", SINGLE, ids=lambda p: p.stem)
def test_skypilot_accepts(recipe: Path):
    sky = pytest.importorskip("sky")
    config = yaml.safe_load(rendered(recipe, "sky"))
    task = sky.Task.from_yaml_config(config)
    # No volume SkyPilot would have to find: the shipped recipes keep state in buckets.
    task.resolve_and_validate_volumes()
    loaded = load_recipe(recipe).recipe
    assert task.num_nodes == loaded.resources.nodes
    assert task.run and "rlx node --backend sky" in task.run
    assert "RLX_RECIPE_JSON" in task.envs
    # the dashboard and every Ray port stay closed to the internet
    for res in task.resources:
        assert not set(map(int, res.ports or [])) & {6379, 8265, 52366}


@pytest.mark.parametrize("recipe", GROUPED, ids=lambda p: p.stem)
def test_skypilot_job_group_loader_accepts(recipe: Path):
    """resources.groups: SkyPilot's own job-group loader reads the rendering as a job group
    of one job per group, the training job primary, each job's nodes and accelerators the
    group's, and each job told its group."""
    pytest.importorskip("sky")
    from sky.utils import dag_utils

    text = rendered(recipe, "sky")
    assert dag_utils.is_job_group_yaml_str(text)
    dag = dag_utils.load_job_group_from_yaml_str(text)
    loaded = load_recipe(recipe).recipe
    groups = loaded.resources.node_groups()
    assert dag.name == loaded.name and dag.execution.value == "parallel"
    assert dag.primary_tasks == ["train"]
    assert [task.name for task in dag.tasks] == [name for name, _ in groups]
    for task, (name, group) in zip(dag.tasks, groups, strict=True):
        assert task.num_nodes == group.nodes
        # one candidate per accelerator alternative of the group
        got = [resources.accelerators for resources in task.resources]
        assert sorted(map(str, got)) == sorted(
            str({option.type: option.count}) for option in group.accelerator_options
        )
        assert task.envs["RLX_NODE_GROUP"] == name
        assert "rlx node --backend sky" in task.run
    for job in list(yaml.safe_load_all(text))[1:]:  # secrets by name on every job
        assert job["secrets"] == dict.fromkeys([*loaded.secrets, "RLX_RAY_TOKEN"])


@pytest.mark.parametrize("recipe", RECIPE_FILES, ids=lambda p: p.stem)
def test_dstack_accepts(recipe: Path):
    pytest.importorskip("dstack")
    from dstack._internal.core.models.configurations import parse_run_configuration

    config = parse_run_configuration(task_text(rendered(recipe, "dstack")))
    loaded = load_recipe(recipe).recipe
    assert config.nodes_num == loaded.resources.total_nodes
    assert str(config.stop_criteria.value) == "master-done"
    groups = loaded.resources.node_groups()
    if not groups:
        assert config.nodes == loaded.resources.nodes
        assert "rlx node --backend dstack" in config.commands[-1]
        return
    # node groups, train first: dstack ranks their nodes in order, the master is rank 0
    assert config.nodes is None
    assert [(g.name, g.nodes) for g in config.groups] == [(n, g.nodes) for n, g in groups]
    for node_group, (_, group) in zip(config.groups, groups, strict=True):
        names = [gpu_name(option.type)[0] for option in group.accelerator_options]
        assert node_group.resources.gpu.name == list(dict.fromkeys(names))
        assert node_group.resources.gpu.count.min == group.gpus_per_node
        assert "rlx node --backend dstack" in node_group.commands[-1]


@pytest.mark.parametrize("recipe", GROUPED, ids=lambda p: p.stem)
def test_slurm_heterogeneous_job(recipe: Path):
    """resources.groups: one component per group after `#SBATCH hetjob`, each with its own
    GPUs; the head in component 0, the rollout nodes' step in component 1."""
    text = rendered(recipe, "slurm")
    loaded = load_recipe(recipe).recipe
    directives = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    split = directives.index("#SBATCH hetjob")
    for part, (_, group) in zip(
        (directives[:split], directives[split + 1 :]), loaded.resources.node_groups(), strict=True
    ):
        assert f"#SBATCH --nodes={group.nodes}" in part
        assert f"#SBATCH --gpus-per-node={group.gpus_per_node}" in part
    assert directives.count("#SBATCH hetjob") == 1
    assert "$SLURM_JOB_NODELIST_HET_GROUP_1" in text
    assert '--het-group=0 --nodes=1 --ntasks=1 --nodelist="$head_node"' in text
    assert "--het-group=1" in text


def test_slurm_container_and_gpus():
    text = rendered(RECIPES / "ppo-7b.yaml", "slurm")
    assert "#SBATCH --gpus-per-node=8" in text
    assert "--container-image='nvcr.io#nvidia/pytorch:24.05-py3'" in text
    assert '--container-name="rlx-${SLURM_JOB_ID}"' in text
    assert "--container-mounts" not in text  # its state is in a bucket, not on a volume
    assert '--output="$job_logs/head.log"' in text
    assert '--output="$job_logs/worker-%N.log"' in text


def test_header_names_version_and_recipe():
    from rlx import __version__

    for recipe, backend in CASES:
        head = "\n".join(rendered(recipe, backend).splitlines()[:3])
        assert f"rlx {__version__}" in head
        assert recipe.name in head


def test_ray_token_is_a_secret_by_name():
    for recipe in RECIPE_FILES:
        *_, sky = yaml.safe_load_all(rendered(recipe, "sky"))  # a job group's last job
        assert sky["secrets"]["RLX_RAY_TOKEN"] is None
        dstack = task_text(rendered(recipe, "dstack"))
        assert "RLX_RAY_TOKEN" in dstack["env"]


def test_cli_render_to_file(tmp_path: Path):
    out = tmp_path / "job.sbatch"
    result = runner.invoke(
        app, ["render", str(RECIPES / "quickstart.yaml"), "-b", "slurm", "-o", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert out.read_text().startswith("#!/bin/bash")
    assert os.access(out, os.X_OK)


def test_cli_render_refuses_lint_errors(write_recipe):
    path = write_recipe("name: job\nray:\n  port: 6380\ncommand: [echo hi]\n")
    result = runner.invoke(app, ["render", str(path), "-b", "sky"])
    assert result.exit_code == 1
    assert f"{path}:3: error: ray.port:" in result.output
    assert "--force" in result.output
    forced = runner.invoke(app, ["render", str(path), "-b", "sky", "--force"])
    assert forced.exit_code == 0


def test_cli_render_unknown_backend(write_recipe):
    path = write_recipe("name: job\ncommand: [echo hi]\n")
    result = runner.invoke(app, ["render", str(path), "-b", "kubernetes"])
    assert result.exit_code != 0
    assert "Traceback" not in result.output


def test_local_dry_run_shows_store_urls_as_written() -> None:
    # the run folder and checkpoints of a bucket keep the URL's two slashes (not gs:/...)
    result = CliRunner().invoke(app, ["launch", "--dry-run", str(RECIPES / "gsm8k-grpo.yaml")])
    assert result.exit_code == 0, result.output
    assert "run folder   gs://rlx-gsm8k/runs/gsm8k-grpo-<date>-<time> (" in result.output
    assert "checkpoints  gs://rlx-gsm8k/checkpoints/<run id> every 25 steps" in result.output
    assert "gs:/r" not in result.output
