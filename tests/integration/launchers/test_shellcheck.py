"""Every Slurm script rlx renders (the shipped recipes' batch scripts, and each container
runtime's batch script and the scripts it runs on the nodes) passes `bash -n` and the
shellcheck of the test environment, at style severity."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from rlx.launchers import render
from tests.conftest import require
from tests.unit.launchers.test_render import RECIPE_FILES, rendered
from tests.unit.launchers.test_slurm_containers import RUNTIMES, node_scripts, recipe_for


def shellcheck(path: Path) -> None:
    subprocess.run(["bash", "-n", str(path)], check=True)
    done = subprocess.run(
        [require("shellcheck"), "--shell=bash", "--severity=style", str(path)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout


@pytest.mark.parametrize("recipe", RECIPE_FILES, ids=lambda p: p.stem)
def test_slurm_script_passes_bash_and_shellcheck(recipe: Path, tmp_path: Path):
    script = tmp_path / "job.sbatch"
    script.write_text(rendered(recipe, "slurm"))
    shellcheck(script)


def test_heterogeneous_job_with_two_training_nodes_passes_shellcheck(tmp_path: Path):
    """resources.groups with training workers besides the head: both components' worker
    steps, waited for as one, and setup in each component."""
    from rlx.recipe.load import parse_recipe

    text = (
        "name: hetero\nsetup: [echo ready]\nresources:\n  groups:\n"
        "    train: {nodes: 2, accelerators: 'H100:8'}\n"
        "    rollout: {nodes: 3, accelerators: 'L4:4', memory: '64'}\n"
        "slurm: {requeue: {retries: 2}}\n"
        "trainer:\n  model: {path: m}\n  data: {train: d.jsonl}\n  layout: split\n"
    )
    script = render("slurm", parse_recipe(text).recipe, "hetero.yaml")
    assert "--het-group=0 --nodes=1 --ntasks=1" in script
    assert '--het-group=0 --nodes=1 --ntasks=1 --nodelist="$workers"' in script
    assert "--het-group=1 --nodes=3 --ntasks=3" in script
    (tmp_path / "job.sbatch").write_text(script)
    shellcheck(tmp_path / "job.sbatch")


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_each_runtime_passes_shellcheck(runtime: str, tmp_path: Path) -> None:
    text = render("slurm", recipe_for(runtime), "boxed.yaml")
    (tmp_path / "job.sbatch").write_text(text)
    shellcheck(tmp_path / "job.sbatch")
    for name, body in node_scripts(recipe_for(runtime)).items():
        (tmp_path / f"{name}.sh").write_text(body)
        shellcheck(tmp_path / f"{name}.sh")


@pytest.mark.parametrize("runtime", ["docker", "podman"])
def test_rdma_devices_pass_shellcheck(runtime: str, tmp_path: Path) -> None:
    """resources.fabric: the container's RDMA flags in the batch script and the node's."""
    from tests.unit.launchers.test_fabric import fabric_box

    recipe = fabric_box(runtime, "infiniband")
    (tmp_path / "job.sbatch").write_text(render("slurm", recipe, "boxed.yaml"))
    shellcheck(tmp_path / "job.sbatch")
    for name, body in node_scripts(recipe).items():
        (tmp_path / f"{name}.sh").write_text(body)
        shellcheck(tmp_path / f"{name}.sh")
