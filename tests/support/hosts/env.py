"""The environment each backend injects into every node's commands, for emulated hosts.

Exact names from the backends' contracts (docs/design.md): the run block rendered for a
backend is run on every emulated host with these variables, as the backend would.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tests.support.hosts.netns import Host


def _sky_env(hosts: Sequence[Host], rank: int, gpus_per_node: int, task_id: str) -> dict[str, str]:
    return {
        "SKYPILOT_NODE_RANK": str(rank),
        "SKYPILOT_NODE_IPS": "\n".join(host.ip for host in hosts),  # head first
        "SKYPILOT_NUM_NODES": str(len(hosts)),
        "SKYPILOT_NUM_GPUS_PER_NODE": str(gpus_per_node),
        "SKYPILOT_TASK_ID": task_id,
    }


def _dstack_env(
    hosts: Sequence[Host], rank: int, gpus_per_node: int, task_id: str
) -> dict[str, str]:
    return {
        "DSTACK_NODE_RANK": str(rank),
        "DSTACK_MASTER_NODE_IP": hosts[0].ip,
        "DSTACK_NODES_IPS": "\n".join(host.ip for host in hosts),
        "DSTACK_NODES_NUM": str(len(hosts)),
        "DSTACK_GPUS_PER_NODE": str(gpus_per_node),
        "DSTACK_GPUS_NUM": str(gpus_per_node * len(hosts)),
        "DSTACK_RUN_NAME": task_id,
    }


BACKEND_ENV: dict[str, Callable[[Sequence[Host], int, int, str], dict[str, str]]] = {
    "sky": _sky_env,
    "dstack": _dstack_env,
}


def backend_env(
    backend: str,
    hosts: Sequence[Host],
    rank: int,
    *,
    gpus_per_node: int = 0,
    task_id: str = "rlx-emulated-task",
) -> dict[str, str]:
    """Variables `backend` ("sky" or "dstack") sets on node `rank` of a cluster of `hosts`.

    `task_id` is SKYPILOT_TASK_ID for SkyPilot and DSTACK_RUN_NAME for dstack.
    """
    try:
        build = BACKEND_ENV[backend]
    except KeyError:
        raise ValueError(
            f"unknown backend {backend!r}; valid: {', '.join(sorted(BACKEND_ENV))}"
        ) from None
    if not 0 <= rank < len(hosts):
        raise ValueError(f"rank {rank} is outside 0..{len(hosts) - 1}")
    return build(hosts, rank, gpus_per_node, task_id)
