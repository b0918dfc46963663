"""Where the trainer's actors go: check the recipe's resources against what Ray sees, and
reserve the actors' slots (rlx.plan.actors counts them) with placement groups so they land
across all nodes and GPUs.

With resources.groups every node carries its group as a Ray label (NODE_GROUP_LABEL, set by
`rlx node`), and every bundle of a placement group selects its group's label: training ranks
land only on training nodes and rollout engines only on rollout nodes.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rlx.errors import RlxError
from rlx.node.env import NODE_GROUP_LABEL
from rlx.plan.actors import bundle_resources
from rlx.recipe.model import Recipe

PLACEMENT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class NodeView:
    node_id: str
    ip: str
    cpus: float
    gpus: float
    group: str | None = None  # its NODE_GROUP_LABEL (resources.groups)


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
                (node.get("Labels") or {}).get(NODE_GROUP_LABEL),
            )
        )
    return nodes


def describe_nodes(nodes: Sequence[NodeView]) -> str:
    if not nodes:
        return "no nodes"
    parts = [
        f"{n.ip} ({n.group + ', ' if n.group else ''}{n.cpus:g} CPUs, {n.gpus:g} GPUs)"
        for n in nodes
    ]
    return f"{len(nodes)} node(s): " + ", ".join(parts)


def check_resources(recipe: Recipe, nodes: Sequence[NodeView], where: str) -> None:
    """The recipe's nodes and GPUs must all be there; else one line saying what is missing."""
    resources = recipe.resources
    if resources.groups is not None:
        _check_groups(recipe, nodes, where)
        return
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


def _check_groups(recipe: Recipe, nodes: Sequence[NodeView], where: str) -> None:
    """Each group's nodes, labelled with its name, with the group's GPUs."""
    for name, group in recipe.resources.node_groups():
        gpus = group.gpus_per_node
        fitting = [n for n in nodes if n.group == name and n.gpus >= gpus and n.cpus >= 1]
        if len(fitting) >= group.nodes:
            continue
        want = f"{group.nodes} node(s) labelled {NODE_GROUP_LABEL}={name}" + (
            f" with {gpus} GPU(s) each" if gpus else ""
        )
        raise RlxError(
            f"resources.groups.{name} asks for {want} but the Ray cluster {where} has "
            f"{describe_nodes(nodes)}; launch it with --backend sky|dstack|slurm, whose nodes "
            "`rlx node` labels with their group"
        )


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
    node_group: str | None = None,
) -> tuple[Any, list[str]]:
    """A ready placement group of `count` one-CPU bundles (with `gpus` GPUs each), or of
    the given bundles, and the IP of the node each bundle landed on. node_group: every
    bundle only on nodes of that group (resources.groups)."""
    import ray
    from ray.util.placement_group import placement_group, placement_group_table

    bundles = bundles or [bundle_resources(1.0, gpus) for _ in range(count)]
    selectors = [{NODE_GROUP_LABEL: node_group} for _ in bundles] if node_group else None
    group = placement_group(bundles, strategy=strategy, bundle_label_selector=selectors)
    try:
        ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(group)
        shapes = ", ".join(sorted({str(b) for b in bundles}))
        if node_group:
            shapes += f" on {NODE_GROUP_LABEL}={node_group} nodes"
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
