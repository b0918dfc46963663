"""Lint checks that concern Slurm (run when the recipe has a slurm section)."""

from __future__ import annotations

import re
from collections.abc import Iterator

from rlx.lint.core import ERROR, WARNING, Check, Problem
from rlx.recipe import Recipe


def check_slurm(recipe: Recipe) -> Iterator[Problem]:
    slurm = recipe.slurm
    if slurm is None:
        return
    if recipe.file_mounts:
        yield Problem(
            ("file_mounts",),
            ERROR,
            "Slurm copies no files to the nodes; put them "
            "on the shared filesystem and list that path under volumes",
        )
    if recipe.resources.image and not slurm.container:
        yield Problem(
            ("resources", "image"),
            WARNING,
            "Slurm ignores resources.image; set slurm.container to run in a container",
        )
    container = slurm.container
    image = container.image if container and container.runtime == "pyxis" else None
    if image and "#" not in image and re.match(r"^[a-z0-9.-]+\.[a-z]+(:[0-9]+)?/", image):
        registry, _, rest = image.partition("/")
        yield Problem(
            ("slurm", "container", "image"),
            WARNING,
            f"pyxis separates the registry with '#': write '{registry}#{rest}'",
        )
    if container and container.runtime in ("docker", "podman"):
        yield Problem(
            ("slurm", "container", "runtime"),
            WARNING,
            f"{container.runtime} containers run outside Slurm's cgroups: the job's CPU and "
            "memory limits do not hold inside them; prefer pyxis or apptainer where the site "
            "has them",
        )
    if recipe.resources.spot:
        yield Problem(
            ("resources", "spot"), WARNING, "Slurm has no spot instances; spot is ignored there"
        )


def check_slurm_groups(recipe: Recipe) -> Iterator[Problem]:
    """resources.groups is a heterogeneous job; a docker or podman container per node is
    started by one step across the whole allocation, which a heterogeneous job has not."""
    slurm = recipe.slurm
    if slurm is None or recipe.resources.groups is None or slurm.container is None:
        return
    runtime = slurm.container.runtime
    if runtime in ("docker", "podman"):
        yield Problem(
            ("slurm", "container", "runtime"),
            ERROR,
            f"{runtime} containers are not run in a heterogeneous job (resources.groups); "
            "use runtime: pyxis or apptainer, or drop groups",
        )


CHECKS: list[Check] = [check_slurm, check_slurm_groups]
