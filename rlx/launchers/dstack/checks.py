"""Lint checks that concern dstack (run when the recipe has a dstack section)."""

from __future__ import annotations

import difflib
from collections.abc import Iterator

from rlx.launchers.dstack import NODE_RANK, per_node
from rlx.launchers.dstack.names import gpu_name
from rlx.launchers.offers import node_kinds
from rlx.lint.core import ERROR, WARNING, Check, Problem
from rlx.recipe import Recipe
from rlx.recipe.model import is_bucket


def check_dstack(recipe: Recipe) -> Iterator[Problem]:
    dstack = recipe.dstack
    if dstack is None:
        return
    for i, volume in enumerate(recipe.volumes):
        if volume.name and recipe.resources.total_nodes > 1 and not per_node(volume.name):
            yield Problem(
                ("volumes", i, "name"),
                ERROR,
                f"a dstack network volume attaches to one node, and this job has "
                f"{recipe.resources.total_nodes}; for state every node shares use a bucket "
                "(trainer.checkpoint.dir: s3://BUCKET/checkpoints), for node-local data name "
                f"one volume per node: {volume.name}-{NODE_RANK}",
            )
    if len(dstack.regions) > 1 and any(v.name for v in recipe.volumes):
        yield Problem(
            ("dstack", "regions"),
            ERROR,
            "a network volume lives in one region, and this run may start in any of "
            f"{', '.join(dstack.regions)}; keep one region, or keep state in a bucket",
        )
    # dstack turns EFA on by itself for the EFA instances of its AWS fleets
    if recipe.resources.fabric == "efa" and dstack.backends and "aws" not in dstack.backends:
        yield Problem(
            ("dstack", "backends"),
            ERROR,
            f"fabric: efa is AWS's, and these backends ({', '.join(dstack.backends)}) leave AWS "
            "out; add aws, or name the fabric these nodes have",
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


def check_gpu_counts(recipe: Recipe) -> Iterator[Problem]:
    """dstack's gpu holds one count (a range would let in every count between)."""
    for path, shape in node_kinds(recipe):
        counts = sorted({option.count for option in shape.accelerator_options})
        if len(counts) > 1:
            yield Problem(
                path,
                ERROR,
                f"dstack takes one GPU count for all its GPU names, and these alternatives ask "
                f"for {' or '.join(map(str, counts))}; give every alternative the same count",
            )


def check_places(recipe: Recipe) -> Iterator[Problem]:
    """dstack takes backends, regions and zones as separate lists, each place any of their
    combinations: a place with a region beside one without would bind both to the region."""
    places = [place.split("/") for place in recipe.resources.infra_list]
    for depth, what in ((2, "region"), (3, "zone")):
        if len({len(p) >= depth for p in places}) > 1:
            yield Problem(
                ("resources", "infra"),
                ERROR,
                f"dstack takes clouds, regions and zones as separate lists, so places with a "
                f"{what} and places without cannot be mixed; give every place a {what}, or none",
            )
            return


def check_twice(recipe: Recipe) -> Iterator[Problem]:
    """resources.infra and max_hourly_cost say for every backend what dstack's own fields
    say: both set would leave one of them silently unused."""
    settings = recipe.dstack
    if settings is None:
        return
    if recipe.resources.max_hourly_cost is not None and settings.max_price is not None:
        yield Problem(
            ("dstack", "max_price"),
            ERROR,
            "resources.max_hourly_cost sets dstack's max_price too; drop dstack.max_price",
        )
    if recipe.resources.max_duration is not None and settings.max_duration is not None:
        yield Problem(
            ("dstack", "max_duration"),
            ERROR,
            "resources.max_duration sets dstack's max_duration too; drop dstack.max_duration",
        )
    retry, deadline = settings.retry, recipe.resources.start_deadline
    if deadline is not None and retry is not None:
        if "duration" in retry.model_fields_set:
            yield Problem(
                ("dstack", "retry", "duration"),
                ERROR,
                "resources.start_deadline sets dstack's retry duration (one for all its "
                "events); drop dstack.retry.duration",
            )
        if "no-capacity" not in retry.on_events:
            yield Problem(
                ("dstack", "retry", "on_events"),
                ERROR,
                "resources.start_deadline is how long dstack retries for want of an offer, "
                "and these events leave no-capacity out; add no-capacity",
            )
    if recipe.resources.infra is not None and (settings.backends or settings.regions):
        yield Problem(
            ("dstack", "backends" if settings.backends else "regions"),
            ERROR,
            "resources.infra sets dstack's backends and regions too; drop dstack.backends "
            "and dstack.regions, or resources.infra",
        )


def check_gpu_names(recipe: Recipe) -> Iterator[Problem]:
    """Names dstack's GPU table (gpuhunt's) does not know match no offer; with several names,
    the one memory range dstack takes may let in a size the recipe does not list."""
    try:
        from gpuhunt import KNOWN_ACCELERATORS
    except ImportError:  # dstack is not installed here: nothing to check against
        return
    known: dict[str, set[int]] = {}
    spelled: dict[str, str] = {}  # lower case -> dstack's spelling
    for info in KNOWN_ACCELERATORS:
        known.setdefault(info.name.lower(), set()).add(info.memory)
        spelled[info.name.lower()] = info.name
    for path, shape in node_kinds(recipe):
        named = [(option.type, *gpu_name(option.type)) for option in shape.accelerator_options]
        for written, name, gib in named:
            sizes = known.get(name.lower())
            if sizes is None or (gib is not None and gib not in sizes):
                if sizes is not None:
                    hint = f"{spelled[name.lower()]} comes in {_sizes(sizes)}; "
                else:
                    near = difflib.get_close_matches(name.lower(), spelled, n=3)
                    guesses = " or ".join(repr(spelled[n]) for n in near)
                    hint = f"did you mean {guesses}? " if near else ""
                yield Problem(
                    path,
                    ERROR,
                    f"dstack knows no GPU {written}; {hint}write one of its names (H100, "
                    "A100-80GB, L4, MI300X...: `dstack offer` lists them)",
                )
                return
        least = min((gib for _, _, gib in named if gib is not None), default=None)
        if least is None:
            continue
        wanted = {(name.lower(), gib) for _, name, gib in named}
        extra = [
            f"{name} {gib}GB"
            for _, name, _ in named
            for gib in sorted(known[name.lower()])
            if gib >= least
            and (name.lower(), gib) not in wanted
            and (name.lower(), None) not in wanted
        ]
        if extra:
            yield Problem(
                path,
                WARNING,
                f"dstack takes one memory range for all GPU names ({least}GB and up here), so "
                f"it may also take {', '.join(dict.fromkeys(extra))}; list those too, or keep "
                "to names of one size",
            )


def _sizes(gib: set[int]) -> str:
    return " or ".join(f"{size}GB" for size in sorted(gib))


def check_order(recipe: Recipe) -> Iterator[Problem]:
    for path, shape in node_kinds(recipe):
        if shape.accelerators_ordered and len(shape.accelerator_options) > 1:
            written = ", ".join(map(str, shape.accelerator_options))
            yield Problem(
                path,
                WARNING,
                "dstack keeps no order among GPU names: it takes the cheapest offer of any; "
                f"write the alternatives as a set ({{{written}}}) to say so",
            )


# What dstack cannot express at all: refused when rendered, lint or not.
RENDER_CHECKS: list[Check] = [check_gpu_counts, check_places, check_twice]


def check_expressible(recipe: Recipe) -> Iterator[Problem]:
    if recipe.dstack is None:
        return
    for check in [*RENDER_CHECKS, check_gpu_names, check_order]:
        yield from check(recipe)


CHECKS: list[Check] = [check_dstack, check_expressible]
