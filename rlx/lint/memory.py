"""`rlx plan`'s verdict as a check: a plan that does not fit is an error saying what to change."""

from __future__ import annotations

from collections.abc import Iterator

from rlx.errors import RlxError
from rlx.lint.core import ERROR, WARNING, Check, Problem
from rlx.recipe import Recipe


def check_memory_plan(recipe: Recipe) -> Iterator[Problem]:
    """`rlx plan`'s verdict: a plan that does not fit is an error saying what to change."""
    from rlx.plan import PlanError, plan_recipe

    if recipe.trainer is None or recipe.command is not None:
        return
    try:
        plan = plan_recipe(recipe)
    except PlanError as exc:
        yield Problem(
            ("trainer", "model", "path"), WARNING, f"memory not checked: {str(exc).rstrip('.')}"
        )
        return
    except RlxError:  # an impossible layout: check_layout says so
        return
    where = ("resources", "accelerators") if recipe.resources.accelerators else ("resources",)
    for problem in plan.problems:
        field = ("resources", "memory") if problem.startswith("host") else where
        yield Problem(field, ERROR, f"does not fit: {problem}")
    for warning in plan.warnings:
        field = ("resources", "memory") if warning.startswith("host") else where
        yield Problem(field, WARNING, f"tight: {warning}")


CHECKS: list[Check] = [
    check_memory_plan,
]
