"""`rlx lint`: what a seasoned user checks before paying for GPUs.

Each check is a small function from a recipe to problems (core.Check), kept in a module by
the kind of thing it checks: trainer.py (the trainer section), lora.py (trainer.model.lora
and critic_model.lora), environment.py (trainer.environment), memory.py (the memory plan of
every accelerator alternative), alternatives.py (the layout with each alternative's GPUs
and `auto` sizes), cluster.py (the Ray cluster), fabric.py (the network joining the
nodes), groups.py (resources.groups), secrets.py, sources.py (prompt files, the reward
function, the context window), storage.py; each backend's own checks
live in its package (rlx/launchers/<name>/checks.py, named in its BackendSpec). all_checks()
lists them all; lint_loaded runs them on a loaded file and points every problem at its line.
prices.py checks cost against prices from outside the recipe, so `rlx lint` adds its check
only when it has prices (a price file, SkyPilot's catalog cache).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from rlx.errors import Finding, RecipeError, RlxError
from rlx.launchers import backend_checks
from rlx.lint import (
    alternatives,
    cluster,
    environment,
    fabric,
    groups,
    lora,
    memory,
    secrets,
    sources,
    storage,
    trainer,
)
from rlx.lint.core import ERROR, WARNING, Check, Problem
from rlx.recipe import LoadedRecipe, Recipe, load_recipe
from rlx.recipe.load import dotted

__all__ = [
    "ERROR",
    "STARTUP_CHECKS",
    "WARNING",
    "Check",
    "Problem",
    "all_checks",
    "lint_file",
    "lint_loaded",
    "refuse_at_startup",
]

# What `rlx train` refuses at start-up, before any actor starts: these very checks, so a recipe
# that lint passes is never refused there, and one that never went through lint (rlx train
# on a file) is refused with the same words. What lint cannot see (the nodes Ray finds, files
# and packages on the head, the data's rows) the trainer checks where it reads them.
STARTUP_CHECKS: tuple[Check, ...] = (
    trainer.check_batch_divisibility,
    trainer.check_tensor_parallel,
    trainer.check_rollout_engine,
    trainer.check_group_size,
    trainer.check_policy_loss,
    trainer.check_rollout_correction,
    trainer.check_overlong,
    trainer.check_filter_groups,
    trainer.check_rollout_dtype,
    trainer.check_layout,
    trainer.check_colocated_tensor_parallel,
    trainer.check_trainer_specs,
    trainer.check_reward_secrets,
    trainer.check_packing_budget,
    trainer.check_checkpoint_best,
    lora.check_lora_target_modules,
    lora.check_lora_rank_servable,
    groups.check_groups_layout,
    groups.check_groups_accelerators,
    groups.check_groups_rollout_gpus,
)


def all_checks() -> list[Check]:
    """Every check, rlx's own and the backends' (gathered when asked: a backend's checks
    module imports lint.core, so nothing is gathered while this package loads)."""
    return [
        *trainer.CHECKS,
        *lora.CHECKS,
        *environment.CHECKS,
        *memory.CHECKS,
        *alternatives.CHECKS,
        *cluster.CHECKS,
        *fabric.CHECKS,
        *groups.CHECKS,
        *secrets.CHECKS,
        *sources.CHECKS,
        *storage.CHECKS,
        *backend_checks(),
    ]


def refuse_at_startup(recipe: Recipe) -> None:
    """Raise RlxError with the first error of STARTUP_CHECKS (field: what to change)."""
    errors = [p for check in STARTUP_CHECKS for p in check(recipe) if p.severity == ERROR]
    if errors:
        first = errors[0]
        more = f" (and {len(errors) - 1} more; `rlx lint` lists them)" if len(errors) > 1 else ""
        raise RlxError(f"{dotted(first.field)}: {first.message}{more}")


def lint_loaded(lr: LoadedRecipe, extra: Sequence[Check] = ()) -> list[Finding]:
    """Every check's findings (and those of `extra`, checks made for this run of lint)."""
    findings = [
        lr.finding(problem.field, problem.severity, problem.message)
        for check in [*all_checks(), *extra]
        for problem in check(lr.recipe)
    ]
    # Per field, errors (what blocks the launch) before warnings (what may follow from them).
    return sorted(findings, key=lambda f: (f.line, f.field, f.severity != ERROR, f.message))


def lint_file(path: str | Path, extra: Sequence[Check] = ()) -> list[Finding]:
    """Every finding for one recipe file: schema errors, or else the semantic checks."""
    try:
        loaded = load_recipe(path)
    except RecipeError as exc:
        return exc.findings
    except RlxError as exc:
        return [Finding(str(path), 1, ERROR, "(recipe)", str(exc).split(": ", 1)[-1])]
    return lint_loaded(loaded, extra)


def recipe_files(paths: Iterable[str | Path]) -> list[Path]:
    """Expand folders into their *.yaml / *.yml files (recursively, sorted)."""
    out: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            out.extend(sorted(p for p in path.rglob("*") if p.suffix in (".yaml", ".yml")))
        elif path.exists():
            out.append(path)
        else:
            raise RlxError(f"{path}: no such file or folder")
    return out
