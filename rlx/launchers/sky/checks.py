"""Lint checks that concern SkyPilot (run when the recipe has a sky section)."""

from __future__ import annotations

from collections.abc import Iterator

from rlx.lint.core import ERROR, Check, Problem
from rlx.recipe import Recipe


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


CHECKS: list[Check] = [check_sky]
