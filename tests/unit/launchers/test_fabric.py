"""resources.fabric in the renderings: SkyPilot asks for network_tier: best (and its own
parser takes it), Slurm's docker/podman containers get the RDMA devices, and a recipe that
names no fabric renders as it always did."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from rlx.launchers import render
from rlx.launchers.slurm import containers
from rlx.recipe import Recipe, load_recipe
from tests.conftest import RECIPES
from tests.unit.launchers.test_slurm_containers import recipe_for


def with_fabric(source: str, fabric: str | None, **sky: Any) -> Recipe:
    data = yaml.safe_load((RECIPES / source).read_text())
    data["resources"].pop("fabric", None)
    if fabric is not None:
        data["resources"]["fabric"] = fabric
    data["sky"] = {**data.get("sky", {}), **sky}
    return Recipe.model_validate(data)


def sky_resources(recipe: Recipe) -> dict[str, Any]:
    return yaml.safe_load(render("sky", recipe, "r.yaml"))["resources"]


def test_skypilot_asks_for_the_best_network_tier() -> None:
    assert sky_resources(load_recipe(RECIPES / "grpo-large.yaml").recipe)["network_tier"] == "best"
    for fabric in ("tcp", None):
        assert "network_tier" not in sky_resources(with_fabric("grpo-large.yaml", fabric))


@pytest.mark.parametrize(("fabric", "infra"), [("efa", "aws"), ("infiniband", "nebius")])
def test_skypilot_takes_the_rendering(fabric: str, infra: str) -> None:
    sky = pytest.importorskip("sky")
    recipe = with_fabric("ppo-7b.yaml", fabric, infra=infra)
    task = sky.Task.from_yaml_config(yaml.safe_load(render("sky", recipe, "r.yaml")))
    candidates = list(task.resources)  # one per accelerator alternative
    assert len(candidates) == len(recipe.resources.accelerator_options) >= 1
    assert all(resources.network_tier.value == "best" for resources in candidates)


def test_no_fabric_renders_as_before() -> None:
    # nothing of the field in the recipe's JSON either: every backend's bytes are unchanged
    recipe = with_fabric("grpo-large.yaml", None)
    for backend in ("sky", "dstack", "slurm"):
        assert '"fabric"' not in render(backend, recipe, "r.yaml")


def fabric_box(runtime: str, fabric: str | None) -> Recipe:
    data = recipe_for(runtime).model_dump(mode="json")
    if fabric is not None:
        data["resources"]["fabric"] = fabric
    return Recipe.model_validate(data)


@pytest.mark.parametrize("runtime", ["docker", "podman"])
def test_slurm_containers_get_the_rdma_devices(runtime: str) -> None:
    flags = "--device /dev/infiniband --cap-add IPC_LOCK --ulimit memlock=-1:-1"
    for fabric in ("efa", "infiniband"):
        recipe = fabric_box(runtime, fabric)
        run = containers.engine_run_script(recipe, recipe.slurm.container)
        assert flags in run  # its shellcheck: tests/integration/launchers/test_shellcheck.py
        assert flags in render("slurm", recipe, "b.yaml")
    for fabric in ("tcp", None):
        recipe = fabric_box(runtime, fabric)
        assert "/dev/infiniband" not in containers.engine_run_script(recipe, recipe.slurm.container)


@pytest.mark.parametrize("runtime", ["pyxis", "apptainer"])
def test_pyxis_and_apptainer_need_no_flags(runtime: str) -> None:
    # enroot's hooks and Apptainer's shared /dev bring the devices
    text = render("slurm", fabric_box(runtime, "efa"), "b.yaml")
    assert "/dev/infiniband" not in text and "IPC_LOCK" not in text
