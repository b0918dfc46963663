"""Where the trainer's actors go: check the recipe's resources against what Ray sees, decide
how many training and rollout workers there are, and reserve their slots with placement
groups so they land across all nodes and GPUs.

Training workers: one per GPU (minus the split layout's rollout GPUs), or one per node on
CPU-only jobs (strictly spread, so every node trains). Rollout workers (layout: split): one
per tensor-parallel group of rollout GPUs; on CPU-only jobs rollout_gpus counts engines
(at least one), a way to exercise the split layout without GPUs.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rlx.errors import RlxError
from rlx.recipe.model import Recipe

PLACEMENT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class NodeView:
    node_id: str
    ip: str
    cpus: float
    gpus: float


@dataclass(frozen=True)
class ActorPlan:
    """How many actors of each kind, and the resources of each."""

    train_workers: int
    train_gpus: int  # per training worker: 1 on GPU jobs, 0 on CPU
    rollout_workers: int  # layout: split only
    rollout_gpus: int  # per rollout worker: its tensor-parallel size, 0 on CPU
    spread_training: bool  # one training worker per node (CPU-only jobs)

    @property
    def bundles(self) -> int:
        return self.train_workers + self.rollout_workers


def alive_nodes() -> list[NodeView]:
    import ray

    nodes = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        resources = node.get("Resources", {})
        nodes.append(
            NodeView(
                node["NodeID"],
                node["NodeManagerAddress"],
                float(resources.get("CPU", 0.0)),
                float(resources.get("GPU", 0.0)),
            )
        )
    return nodes


def describe_nodes(nodes: Sequence[NodeView]) -> str:
    if not nodes:
        return "no nodes"
    parts = [f"{n.ip} ({n.cpus:g} CPUs, {n.gpus:g} GPUs)" for n in nodes]
    return f"{len(nodes)} node(s): " + ", ".join(parts)


def check_resources(recipe: Recipe, nodes: Sequence[NodeView], where: str) -> None:
    """The recipe's nodes and GPUs must all be there; else one line saying what is missing."""
    resources = recipe.resources
    gpus = resources.gpus_per_node
    fitting = [n for n in nodes if n.gpus >= gpus and n.cpus >= 1]
    if len(fitting) >= resources.nodes:
        return
    want = f"{resources.nodes} node(s)" + (f" with {gpus} GPU(s) each" if gpus else "")
    hint = (
        "launch it on a cluster with --backend sky|dstack|slurm, or lower resources.nodes"
        if resources.nodes > len(nodes)
        else "check resources.accelerators against the machines"
    )
    raise RlxError(
        f"the recipe asks for {want} but the Ray cluster {where} has "
        f"{describe_nodes(nodes)}; {hint}"
    )


def plan_actors(recipe: Recipe) -> ActorPlan:
    trainer = recipe.trainer
    assert trainer is not None
    resources = recipe.resources
    total_gpus = resources.total_gpus
    split = trainer.layout == "split"
    tp = trainer.rollout.tensor_parallel_size
    if total_gpus == 0:
        engines = max(trainer.rollout_gpus, 1) if split else 0
        return ActorPlan(resources.nodes, 0, engines, 0, spread_training=True)
    if not split:
        return ActorPlan(total_gpus, 1, 0, 0, spread_training=False)
    if not 0 < trainer.rollout_gpus < total_gpus or trainer.rollout_gpus % tp:
        raise RlxError(
            f"trainer.rollout_gpus {trainer.rollout_gpus}: layout: split needs between 1 and "
            f"{total_gpus - 1} rollout GPUs, a multiple of tensor_parallel_size {tp}"
        )
    return ActorPlan(total_gpus - trainer.rollout_gpus, 1, trainer.rollout_gpus // tp, tp, False)


def check_batch_split(recipe: Recipe, plan: ActorPlan) -> None:
    """The step's samples and each minibatch must split evenly over the training workers
    (every DDP rank runs the same number of micro-batches). Lint checks the same from the
    same plan; this guards recipes that reach the trainer without going through lint."""
    trainer = recipe.trainer
    assert trainer is not None
    ranks = plan.train_workers
    samples = trainer.batch.prompts_per_step * trainer.rollout.n
    minibatch = trainer.batch.minibatch_size or samples
    problem = None
    if samples % minibatch:
        problem = f"minibatch_size {minibatch} does not divide the {samples} samples of a step"
    elif minibatch % ranks:
        problem = f"minibatch_size {minibatch} does not split over {ranks} training workers"
    if problem:
        raise RlxError(f"trainer.batch: {problem}; pick sizes that divide evenly")


def _bundle(cpus: float, gpus: int) -> dict[str, float]:
    return {"CPU": cpus, "GPU": float(gpus)} if gpus else {"CPU": cpus}


def tensor_parallel_bundles(tp: int) -> list[dict[str, float]]:
    """The bundles of one tensor-parallel vLLM engine on GPUs: one GPU each (vLLM's Ray
    executor refuses a bundle of more), the engine's own actor in the first with a CPU.
    Reserved STRICT_PACK: a tensor-parallel group stays on one node."""
    return [_bundle(1.0, 1)] + [{"GPU": 1.0} for _ in range(tp - 1)]


def rollout_actor_options(rollout_gpus: int, group: Any, bundle: int) -> dict[str, Any]:
    """Ray options of a rollout worker in bundle `bundle` of `group`. One GPU (or none):
    the actor holds it and vLLM runs inside. Tensor-parallel on GPUs: the actor holds no
    GPU and its child tasks stay in its group, so vLLM's Ray executor (which takes the
    current placement group) puts one worker on each GPU bundle rlx reserved."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    tensor_parallel = rollout_gpus > 1
    return {
        "num_cpus": 1,
        "num_gpus": 0 if tensor_parallel else rollout_gpus,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=group,
            placement_group_bundle_index=bundle,
            placement_group_capture_child_tasks=tensor_parallel,
        ),
    }


def reserve(
    count: int,
    gpus: int,
    strategy: str,
    what: str,
    nodes: Sequence[NodeView],
    bundles: list[dict[str, float]] | None = None,
) -> tuple[Any, list[str]]:
    """A ready placement group of `count` one-CPU bundles (with `gpus` GPUs each), or of
    the given bundles, and the IP of the node each bundle landed on."""
    import ray
    from ray.util.placement_group import placement_group, placement_group_table

    bundles = bundles or [_bundle(1.0, gpus) for _ in range(count)]
    group = placement_group(bundles, strategy=strategy)
    try:
        ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(group)
        shapes = ", ".join(sorted({str(b) for b in bundles}))
        raise RlxError(
            f"could not place {what} ({len(bundles)} bundles of {shapes}, {strategy}) within "
            f"{PLACEMENT_TIMEOUT_S:.0f} s on {describe_nodes(nodes)}"
        ) from None
    ip_of = {n.node_id: n.ip for n in nodes}
    table = placement_group_table(group)["bundles_to_node_id"]
    return group, [ip_of.get(table[index], "?") for index in range(len(bundles))]


def thread_override() -> int | None:
    """RLX_NUM_THREADS pins the torch threads of every actor (benchmarks use it)."""
    value = os.environ.get("RLX_NUM_THREADS", "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise RlxError(f"RLX_NUM_THREADS={value!r} is not a positive whole number")
    return int(value)


def threads_for(node_share: int, override: int | None) -> int:
    """torch threads for an actor sharing its node's cores with node_share - 1 others (Ray
    does not pin cores, so every actor sees all of them)."""
    if override is not None:
        return override
    return max(len(os.sched_getaffinity(0)) // max(node_share, 1), 1)
