"""Cost, where prices are known: an accelerator alternative that fits and costs less an hour
than the first preference is a warning (rlx.plan.prices.cheaper_choice, the rule `rlx plan`
says too). Prices come from outside the recipe (a price file, SkyPilot's catalog cache), so
this check is made for the prices at hand and is not among all_checks(): with none, lint
says nothing about cost."""

from __future__ import annotations

from collections.abc import Iterator

from rlx.errors import RlxError
from rlx.lint.core import WARNING, Check, Problem
from rlx.lint.memory import accelerators_field
from rlx.plan.prices import Prices, cheaper_choice, price_alternatives
from rlx.recipe import Recipe


def fitting_labels(recipe: Recipe) -> set[str] | None:
    """The labels of the alternatives whose memory plan fits; None where the plan cannot
    say (no trainer, an unknown model or layout: the memory checks report those)."""
    from rlx.plan.planner import plan_alternatives

    if recipe.trainer is None or recipe.command is not None:
        return None
    try:
        return {a.label for a in plan_alternatives(recipe, advise=False) if a.fits}
    except RlxError:  # PlanError included
        return None


def cheaper_check(prices: Prices) -> Check:
    """The check for these prices."""

    def check_cheaper_alternative(recipe: Recipe) -> Iterator[Problem]:
        if len(recipe.alternatives()) < 2:
            return
        fitting = fitting_labels(recipe)
        if not fitting:
            return
        line = cheaper_choice(recipe, price_alternatives(recipe, prices), fitting, prices.source)
        if line is not None:
            yield Problem(accelerators_field(recipe), WARNING, line)

    return check_cheaper_alternative
