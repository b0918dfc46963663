"""The alternatives a recipe lets a backend take: every accelerator option, spot and/or
on-demand, on every place resources.infra names. One list, in order of preference, that each
renderer turns into its backend's native form and `rlx launch --dry-run` prints. Pure."""

from __future__ import annotations

from dataclasses import dataclass

from rlx.recipe import Recipe
from rlx.recipe.model import Accelerator, NodeGroup, Resources


@dataclass(frozen=True)
class Offer:
    """One alternative: an accelerator (None for CPU-only nodes), spot or not, and where."""

    accelerator: Accelerator | None
    spot: bool
    place: str | None

    def cells(self) -> tuple[str, str, str]:
        return (
            str(self.accelerator) if self.accelerator else "CPU",
            "spot" if self.spot else "on-demand",
            self.place or "any place",
        )


def node_kinds(recipe: Recipe) -> list[tuple[tuple[str, ...], Resources | NodeGroup]]:
    """Each kind of node with the path of its accelerators: the job's, or each group's."""
    res = recipe.resources
    if res.groups is None:
        return [(("resources", "accelerators"), res)]
    return [
        (("resources", "groups", name, "accelerators"), group) for name, group in res.node_groups()
    ]


def spot_levels(resources: Resources) -> tuple[bool, ...]:
    """auto is spot first and on-demand when no spot is to be had."""
    if resources.spot == "auto":
        return (True, False)
    return (bool(resources.spot),)


def offers(
    resources: Resources, shape: Resources | NodeGroup, places: list[str]
) -> tuple[list[Offer], bool]:
    """Every alternative for one kind of node, preferred first, and whether the order is a
    preference (a set of accelerators and a list of places are not, spot auto is): spot
    before on-demand, then the accelerators in the recipe's order, then the places."""
    accelerators = shape.accelerator_options or (None,)
    out = [
        Offer(accelerator, spot, place)
        for spot in spot_levels(resources)
        for accelerator in accelerators
        for place in places or [None]
    ]
    ordered = resources.spot == "auto" or (
        shape.accelerators_ordered and len(shape.accelerator_options) > 1
    )
    return out, ordered


def describe(
    recipe: Recipe,
    title: str,
    places: list[str],
    keeps_order: bool = True,
    note: str | None = None,
) -> list[str]:
    """What `rlx launch --dry-run` says about the alternatives (nothing when there is one):
    a line per alternative, per kind of node, and the price cap."""
    res = recipe.resources
    kinds = res.node_groups() or [("", res)]
    lines: list[str] = []
    for name, shape in kinds:
        choices, ordered = offers(res, shape, places)
        if len(choices) <= 1:
            continue
        how = (
            f"{title} takes the first it can get"
            if ordered and keeps_order
            else f"{title} takes any of them (the cheapest it finds)"
        )
        lines.append(f"{name + ' nodes: ' if name else ''}{len(choices)} alternatives, {how}:")
        rows = [offer.cells() for offer in choices]
        widths = [max(len(row[i]) for row in rows) for i in range(3)]
        lines += [
            f"  {i}. "
            + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
            for i, row in enumerate(rows, 1)
        ]
    if lines and res.max_hourly_cost is not None:
        lines.append(f"at most ${res.max_hourly_cost:g} per node and hour")
    if lines and note:
        lines.append(note)
    return lines
