"""Lint checks that concern dstack (run when the recipe has a dstack section)."""

from __future__ import annotations

from collections.abc import Iterator

from rlx.lint.core import ERROR, WARNING, Check, Problem
from rlx.recipe import Recipe
from rlx.recipe.model import is_bucket


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


CHECKS: list[Check] = [check_dstack]
