"""Checks of `resources.groups` (training and rollout nodes of their own kinds) against the
trainer: the split layout, accelerators on both groups or neither, and trainer.rollout_gpus,
which the rollout group decides."""

from __future__ import annotations

from collections.abc import Iterator

from rlx.lint.core import ERROR, Check, Problem
from rlx.recipe import Recipe


def check_groups_layout(recipe: Recipe) -> Iterator[Problem]:
    trainer = recipe.trainer
    if recipe.resources.groups is None or trainer is None or recipe.command is not None:
        return
    if trainer.layout != "split":
        yield Problem(
            ("trainer", "layout"),
            ERROR,
            "resources.groups puts the rollout engines on nodes of their own, which is "
            "layout: split; write layout: split (rollout_gpus then comes from groups.rollout)",
        )


def check_groups_accelerators(recipe: Recipe) -> Iterator[Problem]:
    resources = recipe.resources
    rollout = resources.rollout_nodes
    if rollout is None:
        return
    train = resources.train_nodes
    if bool(train.gpus_per_node) != bool(rollout.gpus_per_node):
        without = "rollout" if train.gpus_per_node else "train"
        yield Problem(
            ("resources", "groups", without),
            ERROR,
            f"groups.{without} has no accelerators while the other group has: both groups "
            "train and generate with the same kind of device; give both accelerators, or "
            "neither (CPU-only)",
        )


def check_groups_rollout_gpus(recipe: Recipe) -> Iterator[Problem]:
    """trainer.rollout_gpus is the rollout group's: left out (0) it is derived; written, it
    must say the same."""
    trainer, rollout = recipe.trainer, recipe.resources.rollout_nodes
    if trainer is None or rollout is None or trainer.rollout_gpus == 0:
        return
    if rollout.gpus_per_node:
        have = rollout.nodes * rollout.gpus_per_node
        what = f"{have} GPUs ({rollout.nodes} x {rollout.accelerators})"
    else:
        have = rollout.nodes
        what = f"{have} engines (one per CPU-only rollout node)"
    if trainer.rollout_gpus != have:
        yield Problem(
            ("trainer", "rollout_gpus"),
            ERROR,
            f"rollout_gpus {trainer.rollout_gpus} differs from the rollout group's {what}; "
            f"with resources.groups leave rollout_gpus out (or write {have})",
        )


CHECKS: list[Check] = [
    check_groups_layout,
    check_groups_accelerators,
    check_groups_rollout_gpus,
]
