"""slurm.container: each runtime's batch script (and the scripts it runs on the nodes)
passes bash -n and shellcheck; the old fields give a migration line."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from rlx.errors import RecipeError
from rlx.launchers import render, slurm
from rlx.recipe import parse_recipe

from .conftest import require

RUNTIMES = ["pyxis", "docker", "podman", "apptainer"]


def recipe_for(runtime: str, gpus: bool = True):
    data = {
        "name": "boxed",
        "resources": {"nodes": 2, **({"accelerators": "H100:8"} if gpus else {})},
        "volumes": [{"path": "/shared"}],
        "setup": ["pip install rlx"],
        "env": {"HF_HOME": "/shared/hf"},
        "secrets": ["HF_TOKEN"],
        "command": ["rlx train"],
        "slurm": {
            "container": {
                "runtime": runtime,
                "image": "img.sif"
                if runtime == "apptainer"
                else "nvcr.io#nvidia/pytorch:24.05-py3",
                "mounts": ["/data:/data:ro"],
            }
        },
    }
    return parse_recipe(yaml.safe_dump(data), "boxed.yaml").recipe


def node_scripts(recipe) -> dict[str, str]:
    """The scripts the batch script hands to `bash -c` on the nodes."""
    container = recipe.slurm.container
    if container.runtime not in ("docker", "podman"):
        return {}
    return {
        "run": slurm._engine_run_script(recipe, container),
        "ready": slurm._engine_ready_script(container.runtime),
    }


def shellcheck(path: Path) -> None:
    subprocess.run(["bash", "-n", str(path)], check=True)
    done = subprocess.run(
        [require("shellcheck"), "--shell=bash", "--severity=style", str(path)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_each_runtime_passes_shellcheck(runtime: str, tmp_path: Path) -> None:
    text = render("slurm", recipe_for(runtime), "boxed.yaml")
    (tmp_path / "job.sbatch").write_text(text)
    shellcheck(tmp_path / "job.sbatch")
    for name, body in node_scripts(recipe_for(runtime)).items():
        (tmp_path / f"{name}.sh").write_text(body)
        shellcheck(tmp_path / f"{name}.sh")


def test_what_each_runtime_renders() -> None:
    pyxis = render("slurm", recipe_for("pyxis"), "b.yaml")
    assert '--container-name="rlx-${SLURM_JOB_ID}"' in pyxis  # scoped to the job
    assert "--container-mounts=/data:/data:ro,/shared:/shared" in pyxis
    docker = render("slurm", recipe_for("docker"), "b.yaml")
    run = node_scripts(recipe_for("docker"))["run"]
    for part in ("--init", "--network host", "--shm-size 16g", "--gpus all", "-v /data:/data:ro"):
        assert part in run, run
    assert "-e HF_TOKEN" in run and "-e RLX_RAY_TOKEN" in run and "trap" in run
    assert (
        "docker exec -e HF_HOME" in docker and '"rlx-${SLURM_JOB_ID}" bash -c "$RLX_NODE"' in docker
    )
    podman = node_scripts(recipe_for("podman"))["run"]
    assert "--device nvidia.com/gpu=all" in podman and "podman run --rm" in podman
    cpu = node_scripts(recipe_for("podman", gpus=False))["run"]
    assert "nvidia.com/gpu" not in cpu
    apptainer = render("slurm", recipe_for("apptainer"), "b.yaml")
    assert (
        'apptainer exec --nv --bind /data:/data:ro,/shared:/shared img.sif bash -c "$RLX_NODE"'
        in (apptainer)
    )


def test_the_old_fields_say_where_they_moved() -> None:
    text = yaml.safe_dump({"name": "old", "command": ["x"], "slurm": {"container_image": "i"}})
    with pytest.raises(RecipeError) as info:
        parse_recipe(text, "old.yaml")
    assert "container_image moved under slurm.container" in str(info.value)
