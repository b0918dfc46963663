"""slurm.container: what each runtime renders into the batch script and the scripts the
nodes run (their shellcheck: tests/integration/launchers/test_shellcheck.py; a real Podman
run on Slurm: tests/hosts/test_slurm_containers.py)."""

from __future__ import annotations

import pytest
import yaml

from rlx.errors import RecipeError
from rlx.launchers import render
from rlx.launchers.slurm import containers
from rlx.recipe import parse_recipe

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
        "run": containers.engine_run_script(recipe, container),
        "ready": containers.engine_ready_script(container.runtime),
    }


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
