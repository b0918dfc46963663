"""Checks that concern one backend, run when the recipe has that backend's section."""

from __future__ import annotations

import re
from collections.abc import Iterator

from rlx.lint.core import ERROR, WARNING, Check, Problem
from rlx.recipe import Recipe
from rlx.recipe.model import is_bucket


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


def check_sky(recipe: Recipe) -> Iterator[Problem]:
    sky = recipe.sky
    if sky is None:
        return
    infra = (sky.infra or "").lower()
    if recipe.resources.spot and infra.startswith(("k8s", "kubernetes", "ssh")):
        yield Problem(
            ("resources", "spot"),
            ERROR,
            f"{sky.infra} has no spot instances; set spot: false or pick a cloud",
        )


def check_dstack(recipe: Recipe) -> Iterator[Problem]:
    dstack = recipe.dstack
    if dstack is None:
        return
    if recipe.resources.nodes > 1 and not dstack.fleets:
        yield Problem(
            ("dstack", "fleets"),
            WARNING,
            "a distributed task needs a fleet with placement: cluster; name it "
            "here so the run does not wait for one that never fits",
        )
    for name, value in recipe.env.items():
        if "\n" in value or "\r" in value:
            yield Problem(
                ("env", name),
                ERROR,
                "dstack cannot pass a value with a line "
                "break; put it in a file in the workdir instead",
            )
    for target, source in recipe.file_mounts.items():
        if is_bucket(source):
            yield Problem(
                ("file_mounts", target),
                WARNING,
                "dstack copies local files only; this bucket is not mounted there",
            )


CHECKS: list[Check] = [
    check_slurm,
    check_sky,
    check_dstack,
]
