"""Every accelerator alternative must suit the recipe's layout: a set or list that mixes
counts (e.g. {H100:8, A100-80GB:4}) must still split the batch over the training ranks and
the rollout GPUs into engines; with `auto` sizes, the size chosen for each alternative must
too. One error per alternative that does not, naming it."""

from __future__ import annotations

from collections.abc import Iterator

from rlx.errors import RlxError
from rlx.lint import groups, trainer
from rlx.lint.core import ERROR, Check, Problem
from rlx.lint.memory import accelerators_field
from rlx.recipe import Recipe
from rlx.recipe.load import dotted

# The checks whose verdict depends on the GPUs per node or on the sizes `auto` chooses.
LAYOUT_CHECKS: tuple[Check, ...] = (
    trainer.check_batch_divisibility,
    trainer.check_tensor_parallel,
    trainer.check_layout,
    trainer.check_colocated_tensor_parallel,
    groups.check_groups_accelerators,
    groups.check_groups_rollout_gpus,
)


def _errors(recipe: Recipe) -> list[Problem]:
    return [p for check in LAYOUT_CHECKS for p in check(recipe) if p.severity == ERROR]


def sized(recipe: Recipe) -> Recipe:
    """The recipe (or one alternative) with its `auto` sizes chosen as its job would (each
    as 1 where the plan cannot say: an unknown model or accelerator, which
    check_memory_plan reports): what a check needing the sizes it runs with reads."""
    from rlx.plan.planner import size_recipe
    from rlx.plan.sizing import auto_fields, with_sizes

    if not auto_fields(recipe):
        return recipe
    try:
        return size_recipe(recipe)[0]
    except RlxError:
        return with_sizes(
            recipe,
            **{name: 1 for name in auto_fields(recipe)},  # type: ignore[arg-type]
        )


def check_alternative_layouts(recipe: Recipe) -> Iterator[Problem]:
    from rlx.plan.sizing import auto_fields

    if recipe.trainer is None or recipe.command is not None:
        return
    alternatives = recipe.alternatives()
    if len(alternatives) == 1 and not auto_fields(recipe):
        return  # the checks above have seen exactly this recipe
    seen = {(p.field, p.message) for p in _errors(recipe)}
    several = len(alternatives) > 1
    for label, alternative in alternatives:
        found = [p for p in _errors(sized(alternative)) if (p.field, p.message) not in seen]
        if not found:
            continue
        first = found[0]
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        with_label = f"with {label}, " if several else "with the sizes auto chose, "
        yield Problem(
            accelerators_field(recipe),
            ERROR,
            f"{with_label}{dotted(first.field)}: {first.message}{more}"
            + (f"; drop {label} from {dotted(accelerators_field(recipe))}" if several else ""),
        )


CHECKS: list[Check] = [
    check_alternative_layouts,
]
