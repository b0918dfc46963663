"""Lint checks that concern Slurm (run when the recipe has a slurm section)."""

from __future__ import annotations

import re
from collections.abc import Iterator

from rlx.launchers.offers import node_kinds
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


def check_gpu_alternatives(recipe: Recipe) -> Iterator[Problem]:
    """One batch script asks for one GPU count per node; several types only by the node
    features the cluster defines for them (slurm.gpu_features)."""
    features = recipe.slurm.gpu_features if recipe.slurm else {}
    for path, shape in node_kinds(recipe):
        options = shape.accelerator_options
        if len(options) <= 1:
            continue
        counts = sorted({option.count for option in options})
        if len(counts) > 1:
            yield Problem(
                path,
                ERROR,
                f"a Slurm job asks for one GPU count per node, and these alternatives ask for "
                f"{' or '.join(map(str, counts))}; give every alternative the same count",
            )
            continue
        unmapped = [option.type for option in options if option.type not in features]
        if unmapped:
            example = ", ".join(f"{o.type}: {o.type.split('-')[0].lower()}" for o in options)
            yield Problem(
                path,
                ERROR,
                "Slurm takes one accelerator type, or several by the node features the cluster "
                f"gives them; map each type to its feature, slurm.gpu_features: {{{example}}} "
                f"(no feature for {', '.join(unmapped)}), or keep one type",
            )


def check_no_prices(recipe: Recipe) -> Iterator[Problem]:
    if recipe.resources.max_hourly_cost is not None:
        yield Problem(
            ("resources", "max_hourly_cost"),
            ERROR,
            "a Slurm cluster has no prices to cap, so --backend slurm refuses max_hourly_cost; "
            "drop it, or launch on sky or dstack",
        )
    if recipe.resources.infra is not None:
        yield Problem(
            ("resources", "infra"),
            ERROR,
            "a Slurm job runs on its own cluster, not a cloud place, so --backend slurm refuses "
            "resources.infra; drop it, or launch on sky or dstack",
        )


def check_time_twice(recipe: Recipe) -> Iterator[Problem]:
    if recipe.resources.max_duration is not None and recipe.slurm and recipe.slurm.time:
        yield Problem(
            ("slurm", "time"),
            ERROR,
            "resources.max_duration sets Slurm's --time too; drop slurm.time",
        )


def check_deadline_has_time(recipe: Recipe) -> Iterator[Problem]:
    """Slurm drops a job that cannot end before its --deadline: without the job's time
    limit the deadline cannot say when it must start."""
    if recipe.resources.start_deadline is None:
        return
    if recipe.resources.max_duration is None and not (recipe.slurm and recipe.slurm.time):
        yield Problem(
            ("resources", "start_deadline"),
            ERROR,
            "Slurm's --deadline drops a job that cannot end before it, so on Slurm a start "
            "deadline needs the job's time limit; set resources.max_duration (e.g. 12h)",
        )


# What one batch script cannot express: refused when rendered, lint or not.
RENDER_CHECKS: list[Check] = [
    check_gpu_alternatives,
    check_no_prices,
    check_time_twice,
    check_deadline_has_time,
]


def check_expressible(recipe: Recipe) -> Iterator[Problem]:
    """RENDER_CHECKS for a recipe with a slurm section. A price cap, places or a start
    deadline with no time limit are for the clouds a recipe also runs on: a warning here,
    refused only on a Slurm launch."""
    if recipe.slurm is None:
        return
    yield from check_gpu_alternatives(recipe)
    yield from check_time_twice(recipe)
    for check in (check_no_prices, check_deadline_has_time):
        for problem in check(recipe):
            yield Problem(problem.field, WARNING, problem.message)


def check_deadline_and_requeue(recipe: Recipe) -> Iterator[Problem]:
    slurm = recipe.slurm
    if slurm and slurm.requeue and recipe.resources.start_deadline is not None:
        yield Problem(
            ("resources", "start_deadline"),
            WARNING,
            "Slurm keeps a job's --deadline when it requeues it, so an attempt that cannot end "
            "before the deadline is dropped instead of retried; drop the start deadline, or "
            "slurm.requeue",
        )


CHECKS: list[Check] = [
    check_slurm,
    check_slurm_groups,
    check_expressible,
    check_deadline_and_requeue,
]
