"""`trainer.parallel.strategy`: how the training ranks share the models, decided once from the
recipe, its memory plan and the network joining the nodes. The planner, lint and the trainer
all ask choose_strategy.

The rule: one training rank is a plain module ('single'); an explicit 'fsdp' or 'ddp' is
kept; 'auto' is 'ddp' when the training ranks span several GPU nodes joined by no fast fabric
(resources.fabric unset or tcp) and the replicated state leaves every training GPU the spare
memory lint asks for (HEADROOM), else 'fsdp' (always on CPU ranks, and when host offload,
an FSDP2 feature, is asked for). Why: FSDP all-gathers the weights and
reduce-scatters the gradients at every micro-batch, DDP all-reduces the gradients once per
minibatch; over TCP between nodes that difference is most of a step, and inside a node or
over EFA/InfiniBand it is not worth DDP's memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from rlx.plan.budget import (
    HEADROOM,
    Layout,
    gib,
    gpu_capacity,
    layout_of,
    training_budget,
)
from rlx.plan.shapes import PlanError, find_shape
from rlx.recipe.model import Recipe

Strategy = Literal["single", "ddp", "fsdp"]


@dataclass(frozen=True)
class StrategyChoice:
    """The strategy a run uses and why, in one line."""

    strategy: Strategy
    reason: str
    # 'fsdp' because DDP was planned and leaves less than HEADROOM spare (not for want of a
    # plan: an unknown model or accelerator)
    ddp_short_of_headroom: bool = False


def choose_strategy(recipe: Recipe, env: Mapping[str, str] | None = None) -> StrategyChoice:
    """The strategy the training ranks of `recipe` use (see the module's rule). env: where
    model shapes are looked up (the Hugging Face cache's variables; None: this process's).
    The recipe's sizes are the ones it runs with: `auto` chosen first
    (rlx.plan.planner.size_recipe), as the plan, lint and the trainer do; one left is an
    RlxError naming its field. PlanError for a recipe without a trainer section; RlxError
    for an impossible layout."""
    trainer = recipe.trainer
    if trainer is None:
        raise PlanError(f"recipe {recipe.name!r} has no trainer section; nothing to train")
    layout = layout_of(recipe)
    ranks = layout.train_ranks
    parallel = trainer.parallel
    asked = parallel.strategy
    if ranks <= 1:
        return StrategyChoice("single", "one training rank: a plain module")
    if asked != "auto":
        return StrategyChoice(asked, f"trainer.parallel.strategy: {asked}")
    resources = recipe.resources
    if resources.gpus_per_node == 0:
        return StrategyChoice("fsdp", f"auto: {ranks} CPU ranks shard the models")
    offload = [f for f in ("offload_optimizer", "offload_reference") if getattr(parallel, f)]
    if trainer.model.lora is not None and "offload_reference" in offload:
        offload.remove("offload_reference")  # no reference copy to offload: the base is it
    if offload:  # host offload is an FSDP2 feature: asking for it asks for FSDP
        return StrategyChoice("fsdp", f"auto: host offload ({', '.join(offload)}) is FSDP's")
    nodes = layout.train_nodes
    if nodes <= 1:
        return StrategyChoice("fsdp", f"auto: {ranks} ranks on one node shard the models")
    where = f"{ranks} ranks on {nodes} nodes"
    if resources.fast_fabric:
        return StrategyChoice("fsdp", f"auto: {where} joined by {resources.fabric}")
    where += ", no fast fabric"
    try:
        peak, capacity = _replicated_peak(recipe, layout, env)
    except PlanError as exc:
        return StrategyChoice("fsdp", f"auto: {where}; DDP not planned: {exc}")
    need = f"{gib(peak)} of {gib(capacity)} GiB"
    if 1 - peak / capacity >= HEADROOM:
        return StrategyChoice("ddp", f"auto: {where}, and DDP fits ({need} per GPU)")
    return StrategyChoice(
        "fsdp",
        f"auto: {where}, but DDP needs {need} per GPU (keep {HEADROOM:.0%} spare)",
        ddp_short_of_headroom=True,
    )


def _replicated_peak(
    recipe: Recipe, layout: Layout, env: Mapping[str, str] | None
) -> tuple[int, int]:
    """(peak, capacity) in bytes of a training GPU with every model replicated (DDP)."""
    trainer = recipe.trainer
    assert trainer is not None
    shape = find_shape(trainer.model.path, env)
    critic = None
    if trainer.algorithm == "ppo":
        critic = find_shape((trainer.critic_model or trainer.model).path, env)
    capacity = gpu_capacity(recipe.resources.train_nodes, env)
    assert capacity is not None  # GPU nodes
    budget = training_budget(trainer, shape, critic, layout, "ddp", True, capacity)
    return budget.peak, capacity
