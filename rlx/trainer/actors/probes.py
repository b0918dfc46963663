"""The start-up probe of rlx.trainer.checkpoint.probe on every node of the Ray cluster, as
a task pinned to each node before the actors (and their models) start."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlx.trainer.checkpoint.probe import Location, probe_on_node


def probe_nodes(places: Sequence[Location], nodes: Sequence[Any]) -> None:
    """The same probe on every other node of the Ray cluster, in a task pinned to each
    (their credentials, disks and network are their own); the first problem names the
    node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from rlx.trainer.actors.cluster import gather

    head_ip = ray.util.get_node_ip_address()
    others = [node for node in nodes if node.ip != head_ip]
    if not others:
        return
    task = ray.remote(num_cpus=0, max_retries=0)(probe_on_node)
    refs = [
        task.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False)
        ).remote(list(places), node.ip)
        for node in others
    ]
    gather(refs, "node")
