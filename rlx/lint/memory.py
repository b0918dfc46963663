"""`rlx plan`'s verdict as a check, for every accelerator alternative: a plan that does not
fit is an error saying what to change, and an accelerator the plan cannot size is an error
too, since nothing vouches for it."""

from __future__ import annotations

from collections.abc import Iterator

from rlx.errors import RlxError
from rlx.lint.core import ERROR, WARNING, Check, Problem
from rlx.recipe import Recipe
from rlx.recipe.yamlpos import Path_


def accelerators_field(recipe: Recipe) -> Path_:
    """Where the recipe names its accelerators (the train group's with groups)."""
    if recipe.resources.groups is not None:
        return ("resources", "groups", "train", "accelerators")
    if recipe.resources.accelerators:
        return ("resources", "accelerators")
    return ("resources",)


def check_memory_plan(recipe: Recipe) -> Iterator[Problem]:
    """`rlx plan`'s verdict for each alternative: a plan that does not fit (or an `auto` size
    with no valid value) is an error saying what to change; an accelerator with no memory
    size is an error; a model whose shape is unknown leaves memory unchecked (a warning)."""
    from rlx.plan import PlanError
    from rlx.plan.planner import plan_alternatives

    if recipe.trainer is None or recipe.command is not None:
        return
    try:
        alternatives = plan_alternatives(recipe)
    except PlanError as exc:
        field = _unplanned_model(recipe)
        if field is not None:
            yield Problem(field, WARNING, f"memory not checked: {str(exc).rstrip('.')}")
        return
    except RlxError:  # an impossible layout: check_layout says so
        return
    where = accelerators_field(recipe)
    several = len(alternatives) > 1
    # dropping one is a remedy only while another fits
    others_fit = sum(a.fits for a in alternatives) > 0
    for alternative in alternatives:
        label = f"{alternative.label}: " if several else ""
        plan = alternative.plan
        if plan is None:
            yield Problem(where, ERROR, f"{label}{alternative.error}")
            continue
        if several and plan.problems:  # one error per alternative: the first reason
            problem, more = plan.problems[0], len(plan.problems) - 1
            sized = problem.startswith("trainer.")  # says what to do itself
            host = problem.startswith("host")
            yield Problem(
                ("resources", "memory") if host else where,
                ERROR,
                f"{label}does not fit: {problem}"
                + ("" if sized or host else _remedy(recipe, alternative.label, others_fit))
                + (f" (and {more} more; `rlx plan` shows them)" if more else ""),
            )
            continue
        for problem in plan.problems:
            field = ("resources", "memory") if problem.startswith("host") else where
            yield Problem(field, ERROR, f"does not fit: {problem}")
        for warning in plan.warnings:
            field = ("resources", "memory") if warning.startswith("host") else where
            yield Problem(field, WARNING, f"{label}tight: {warning}")


def _unplanned_model(recipe: Recipe) -> Path_ | None:
    """The model field whose shape the plan lacks: the critic's when the policy's is known.
    None when a model's path is a URL with a slash missing: check_store_urls says that, and
    advice to fetch its config would send people the wrong way."""
    from rlx.plan import PlanError, find_shape
    from rlx.storage import url_problem

    trainer = recipe.trainer
    assert trainer is not None
    models = [("model", trainer.model.path)]
    if trainer.algorithm == "ppo" and trainer.critic_model is not None:
        models.append(("critic_model", trainer.critic_model.path))
    if any(url_problem(path) is not None for _, path in models):
        return None
    for field, path in models[:-1]:
        try:
            find_shape(path)
        except PlanError:
            return ("trainer", field, "path")
    return ("trainer", models[-1][0], "path")


def _remedy(recipe: Recipe, label: str, others_fit: bool) -> str:
    """For an alternative that does not fit: drop it (while another fits), or the `auto`
    sizes that make it fit (when some are fixed and auto would fit it)."""
    from rlx.plan.planner import plan_recipe
    from rlx.plan.sizing import AUTO_FIELDS, auto_fields, with_sizes

    drop = f"; or drop {label} from {'.'.join(accelerators_field(recipe))}" if others_fit else ""
    fixed = [name for name in AUTO_FIELDS if name not in auto_fields(recipe)]
    if not fixed:
        return drop
    automatic = with_sizes(
        recipe,
        **{name: "auto" for name in fixed},  # type: ignore[arg-type]
    )
    alternative = dict(automatic.alternatives())[label]
    try:
        plan = plan_recipe(alternative, advise=False)
    except RlxError:
        return drop
    if not plan.fits or plan.sizes is None:
        return drop
    trainer = recipe.trainer
    assert trainer is not None
    written = {
        "micro_batch_size": trainer.batch.micro_batch_size,
        "gpu_memory_utilization": trainer.rollout.gpu_memory_utilization,
        "tensor_parallel_size": trainer.rollout.tensor_parallel_size,
    }
    changed = [name for name in fixed if getattr(plan.sizes, name) != written[name]]
    if not changed:
        return drop
    chosen = ", ".join(
        f"{'.'.join(AUTO_FIELDS[name][1:])}: auto ({getattr(plan.sizes, name):g} here)"
        for name in changed
    )
    follow = f"let the sizes follow the GPU: {chosen}"
    return f"{drop}, or {follow}" if drop else f"; or {follow}"


CHECKS: list[Check] = [
    check_memory_plan,
]
