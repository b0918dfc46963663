"""How many actors of each kind a recipe's job runs, and the resources of each: the arithmetic
the trainer places by (rlx.trainer.actors.placement) and the planner and lint count with.

Training workers: one per GPU (minus the split layout's rollout GPUs), or one per node on
CPU-only jobs (strictly spread, so every node trains). Rollout workers (layout: split): one
per tensor-parallel group of rollout GPUs; on CPU-only jobs rollout_gpus counts engines
(at least one), a way to exercise the split layout without GPUs. Pure: no Ray, no torch.

With resources.groups the training ranks fill the train group's GPUs (one per train node on
CPU) and the engines the rollout group's (one per rollout node on CPU, strictly spread), and
each kind is placed only on nodes labelled with its group.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlx.errors import RlxError
from rlx.recipe.model import Recipe, fixed_int


@dataclass(frozen=True)
class ActorPlan:
    """How many actors of each kind, and the resources of each."""

    train_workers: int
    train_gpus: int  # per training worker: 1 on GPU jobs, 0 on CPU
    rollout_workers: int  # layout: split only
    rollout_gpus: int  # per rollout worker: its tensor-parallel size, 0 on CPU
    spread_training: bool  # one training worker per node (CPU-only jobs)
    # resources.groups: the group (a node label) each kind of actor is placed in
    train_group: str | None = None
    rollout_group: str | None = None
    spread_rollout: bool = False  # one engine per rollout node (CPU-only groups)
    train_per_node: int = 0  # GPUs per training node: the ranks a whole node holds

    @property
    def bundles(self) -> int:
        return self.train_workers + self.rollout_workers


def plan_actors(recipe: Recipe) -> ActorPlan:
    trainer = recipe.trainer
    assert trainer is not None
    resources = recipe.resources
    if resources.groups is not None:
        return _plan_groups(recipe)
    total_gpus = resources.total_gpus
    split = trainer.layout == "split"
    tp = fixed_int(trainer.rollout.tensor_parallel_size, "trainer.rollout.tensor_parallel_size")
    if total_gpus == 0:
        engines = max(trainer.rollout_gpus, 1) if split else 0
        return ActorPlan(resources.nodes, 0, engines, 0, spread_training=True)
    per_node = resources.gpus_per_node
    if not split:
        return ActorPlan(total_gpus, 1, 0, 0, spread_training=False, train_per_node=per_node)
    if not 0 < trainer.rollout_gpus < total_gpus or trainer.rollout_gpus % tp:
        raise RlxError(
            f"trainer.rollout_gpus {trainer.rollout_gpus}: layout: split needs between 1 and "
            f"{total_gpus - 1} rollout GPUs, a multiple of tensor_parallel_size {tp}"
        )
    return ActorPlan(
        total_gpus - trainer.rollout_gpus,
        1,
        trainer.rollout_gpus // tp,
        tp,
        False,
        train_per_node=per_node,
    )


def training_groups(plan: ActorPlan) -> list[int]:
    """How the training ranks are reserved: one group strictly spread over the nodes on CPU
    (a rank per node); on GPUs one group per node's worth of ranks (train_per_node), each
    packed on one node, so the ranks take whole nodes."""
    if plan.spread_training or plan.train_per_node <= 0:
        return [plan.train_workers]
    whole, rest = divmod(plan.train_workers, plan.train_per_node)
    return [plan.train_per_node] * whole + ([rest] if rest else [])


def group_engines(recipe: Recipe) -> int:
    """The engines a job with groups runs: one per tensor-parallel set of the rollout
    group's GPUs, or one per rollout node on CPU-only nodes."""
    trainer, rollout = recipe.trainer, recipe.resources.rollout_nodes
    assert trainer is not None and rollout is not None
    if rollout.gpus_per_node == 0:
        return rollout.nodes
    tp = fixed_int(trainer.rollout.tensor_parallel_size, "trainer.rollout.tensor_parallel_size")
    return rollout.nodes * rollout.gpus_per_node // tp


def _plan_groups(recipe: Recipe) -> ActorPlan:
    trainer, resources = recipe.trainer, recipe.resources
    assert trainer is not None
    train, rollout = resources.train_nodes, resources.rollout_nodes
    assert rollout is not None
    tp = fixed_int(trainer.rollout.tensor_parallel_size, "trainer.rollout.tensor_parallel_size")
    if trainer.layout != "split" or bool(train.gpus_per_node) != bool(rollout.gpus_per_node):
        raise RlxError(
            "resources.groups: needs trainer.layout: split and accelerators on both groups or "
            "on neither (`rlx lint` says which)"
        )
    if rollout.gpus_per_node % tp:
        raise RlxError(
            f"trainer.rollout.tensor_parallel_size {tp} does not divide the rollout group's "
            f"{rollout.gpus_per_node} GPUs per node"
        )
    engines = group_engines(recipe)
    if not train.gpus_per_node:
        return ActorPlan(train.nodes, 0, engines, 0, True, "train", "rollout", True)
    return ActorPlan(
        train.nodes * train.gpus_per_node,
        1,
        engines,
        tp,
        False,
        "train",
        "rollout",
        train_per_node=train.gpus_per_node,
    )


def bundle_resources(cpus: float, gpus: int) -> dict[str, float]:
    return {"CPU": cpus, "GPU": float(gpus)} if gpus else {"CPU": cpus}


def tensor_parallel_bundles(tp: int) -> list[dict[str, float]]:
    """The bundles of one tensor-parallel vLLM engine on GPUs: one GPU each (vLLM's Ray
    executor refuses a bundle of more), the engine's own actor in the first with a CPU.
    Reserved STRICT_PACK: a tensor-parallel group stays on one node."""
    return [bundle_resources(1.0, 1)] + [{"GPU": 1.0} for _ in range(tp - 1)]
