"""Where am I? Rank, node addresses and GPUs from the environment each backend injects.

Exact variable names (checked against each project's source):
- SkyPilot: SKYPILOT_NODE_RANK, SKYPILOT_NODE_IPS (one per line, head first),
  SKYPILOT_NUM_NODES, SKYPILOT_NUM_GPUS_PER_NODE, SKYPILOT_TASK_ID.
- dstack: DSTACK_NODE_RANK, DSTACK_MASTER_NODE_IP, DSTACK_NODES_IPS (one per line),
  DSTACK_NODES_NUM, DSTACK_GPUS_PER_NODE, DSTACK_RUN_NAME.
- Slurm: RLX_NODE_HOSTS (the job's hostnames, head first, set by the rendered sbatch script
  from `scontrol show hostnames`), SLURMD_NODENAME, SLURM_JOB_ID.

With resources.groups (training and rollout nodes of their own kinds) every node's rank is
its place in the whole job, training nodes first, so the head is the first training node:
- SkyPilot runs each group as a job of a job group (its own cluster): SKYPILOT_NODE_RANK,
  SKYPILOT_NODE_IPS and SKYPILOT_NUM_NODES are the group's own, RLX_NODE_GROUP (set by the
  rendered job) names the group, and the other group's nodes are found by the hostnames
  SkyPilot gives every node of a job group, `<job>-<i>.<SKYPILOT_JOBGROUP_NAME>`.
- dstack numbers the nodes of all its node groups in order: DSTACK_NODE_RANK and
  DSTACK_NODES_IPS are the whole job's, DSTACK_GPUS_PER_NODE this node's.
- Slurm: the batch script lists the heterogeneous job's train component's hosts first.

This module is also the one home of the variables rlx itself sets on the nodes (renderers
write them, `rlx node` and `rlx train` read them), and of the recipe's form on the nodes:
the whole validated recipe as one line of JSON, so nodes need no copy of the recipe file.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from rlx.errors import RlxError

if TYPE_CHECKING:
    from rlx.recipe.model import Recipe, Resources

# Set by every rendered job on every node.
RECIPE_ENV = "RLX_RECIPE_JSON"  # the recipe (recipe_json)
RAY_TOKEN_SECRET = "RLX_RAY_TOKEN"  # the job's Ray token, a secret: never written to a file
WHEEL_ENV = "RLX_WHEEL"  # the wheel of the launching rlx, shipped with the job
# Set by the Slurm batch script.
NODE_HOSTS_ENV = "RLX_NODE_HOSTS"  # the job's hostnames, head first, one per line
JOB_DIR_ENV = "RLX_JOB_DIR"  # the job's own folder on the shared filesystem (absolute)
# Chosen by the user (or a launcher) to name the run, so a relaunch continues it.
RUN_ID_ENV = "RLX_RUN_ID"
# resources.groups: the group a node belongs to (set per job of a SkyPilot job group), and
# the Ray node label every node of such a job carries, which placement selects by.
NODE_GROUP_ENV = "RLX_NODE_GROUP"
NODE_GROUP_LABEL = "rlx-node-group"
SKY_JOB_GROUP_ENV = "SKYPILOT_JOBGROUP_NAME"
# NCCL's and libfabric's variables for each resources.fabric, set on every node before Ray
# starts (so the trainer's processes inherit them) unless the node's environment already
# has them: the recipe's env, or what the backend or the cluster sets, always wins.
FABRIC_ENV: dict[str, dict[str, str]] = {
    # aws-ofi-nccl runs NCCL over libfabric: its EFA provider, never its TCP one; Ray and
    # vLLM start processes with fork, which EFA's registered memory must survive.
    "efa": {"FI_PROVIDER": "efa", "FI_EFA_FORK_SAFE": "1"},
    # NCCL's own InfiniBand (and RoCE) transport, required: without the devices (a container
    # without /dev/infiniband) NCCL fails at its first collective instead of quietly using
    # TCP sockets.
    "infiniband": {"NCCL_IB_DISABLE": "0", "NCCL_NET": "IB"},
    "tcp": {},
}
# How long a node waits for the other group's hostnames to resolve (SkyPilot fills them in
# as its job group's nodes come up; on Kubernetes a background updater writes them).
RESOLVE_SECONDS = 300.0


def fabric_env(recipe: Recipe, present: Mapping[str, str]) -> dict[str, str]:
    """The variables resources.fabric asks for that neither `present` (the node's
    environment) nor the recipe's env sets."""
    wanted = FABRIC_ENV.get(recipe.resources.fabric or "tcp", {})
    return {k: v for k, v in wanted.items() if k not in present and k not in recipe.env}


def recipe_json(recipe: Recipe) -> str:
    """The whole validated recipe as one line of JSON (JSON holds no raw newline), as it
    travels in RECIPE_ENV."""
    return json.dumps(
        recipe.model_dump(mode="json"), separators=(",", ":"), sort_keys=False, ensure_ascii=True
    )


def recipe_from_env(env: Mapping[str, str]) -> Recipe:
    """The recipe a rendered job carries in RECIPE_ENV; one line when it is missing or was
    written by another rlx version."""
    from pydantic import ValidationError

    from rlx.recipe.model import Recipe

    raw = env.get(RECIPE_ENV)
    if not raw:
        raise RlxError(
            "no recipe: give the recipe file, or run inside a rendered job (which sets "
            f"{RECIPE_ENV})"
        )
    try:
        return Recipe.model_validate_json(raw)
    except ValidationError as exc:
        raise RlxError(
            f"{RECIPE_ENV} does not hold a valid recipe ({exc.error_count()} "
            "errors); render the job again with this rlx version"
        ) from None


BACKEND_MARKERS = (
    ("sky", "SKYPILOT_NODE_RANK"),
    ("dstack", "DSTACK_NODE_RANK"),
    ("slurm", "SLURM_JOB_ID"),
)


@dataclass(frozen=True)
class NodeInfo:
    backend: str
    rank: int
    node_ips: tuple[str, ...]  # head first
    node_names: tuple[str, ...]  # for messages: hostnames where known, else the IPs
    gpus_per_node: int  # this node's
    run_id: str | None
    # resources.groups: each node's group and GPUs, head first; () for a job without groups
    groups: tuple[str, ...] = ()
    node_gpus: tuple[int, ...] = ()

    @property
    def num_nodes(self) -> int:
        return len(self.node_ips)

    @property
    def expected_gpus(self) -> int:
        """Every GPU of the job."""
        return sum(self.node_gpus) if self.node_gpus else self.num_nodes * self.gpus_per_node

    @property
    def own_group(self) -> str | None:
        return self.groups[self.rank] if self.groups else None

    @property
    def head_ip(self) -> str:
        return self.node_ips[0]

    @property
    def own_ip(self) -> str:
        return self.node_ips[self.rank]

    @property
    def is_head(self) -> bool:
        return self.rank == 0

    def describe(self, rank: int) -> str:
        name, ip = self.node_names[rank], self.node_ips[rank]
        where = name if name == ip else f"{name}, {ip}"
        group = f"{self.groups[rank]}, " if self.groups else ""
        return f"node {rank} ({group}{where})"


def detect_backend(env: Mapping[str, str]) -> str:
    for backend, marker in BACKEND_MARKERS:
        if marker in env:
            return backend
    return "local"


def _need(env: Mapping[str, str], name: str, backend: str) -> str:
    value = env.get(name)
    if value is None or value.strip() == "":
        raise RlxError(
            f"{name} is not set: `rlx node --backend {backend}` runs inside a "
            f"{backend} job, which sets it"
        )
    return value.strip()


def _int(env: Mapping[str, str], name: str, backend: str, default: int | None = None) -> int:
    if default is not None and not env.get(name, "").strip():
        return default
    raw = _need(env, name, backend)
    try:
        return int(raw)
    except ValueError:
        raise RlxError(f"{name}={raw!r} is not a whole number") from None


def _lines(raw: str) -> tuple[str, ...]:
    return tuple(line.strip() for line in raw.splitlines() if line.strip())


def _checked(
    backend: str,
    rank: int,
    ips: tuple[str, ...],
    names: tuple[str, ...],
    gpus: int,
    run_id: str | None,
    expected: int | None = None,
) -> NodeInfo:
    if expected is not None and expected != len(ips):
        raise RlxError(f"{backend}: {expected} nodes announced but {len(ips)} node addresses given")
    if not 0 <= rank < len(ips):
        raise RlxError(f"{backend}: node rank {rank} is outside 0..{len(ips) - 1}")
    if gpus < 0:
        raise RlxError(f"{backend}: negative GPU count {gpus}")
    return NodeInfo(backend, rank, ips, names, gpus, run_id)


def from_sky(env: Mapping[str, str]) -> NodeInfo:
    ips = _lines(_need(env, "SKYPILOT_NODE_IPS", "sky"))
    return _checked(
        "sky",
        _int(env, "SKYPILOT_NODE_RANK", "sky"),
        ips,
        ips,
        _int(env, "SKYPILOT_NUM_GPUS_PER_NODE", "sky", default=0),
        env.get("SKYPILOT_TASK_ID"),
        _int(env, "SKYPILOT_NUM_NODES", "sky"),
    )


def from_dstack(env: Mapping[str, str]) -> NodeInfo:
    ips = _lines(env.get("DSTACK_NODES_IPS", ""))
    master = _need(env, "DSTACK_MASTER_NODE_IP", "dstack")
    if not ips:
        raise RlxError(
            "DSTACK_NODES_IPS is not set: `rlx node --backend dstack` runs inside a "
            "dstack task, which sets it"
        )
    if ips[0] != master:
        # dstack lists the master first; trust the explicit master address if not.
        ips = (master, *(ip for ip in ips if ip != master))
    return _checked(
        "dstack",
        _int(env, "DSTACK_NODE_RANK", "dstack"),
        ips,
        ips,
        _int(env, "DSTACK_GPUS_PER_NODE", "dstack", default=0),
        env.get("DSTACK_RUN_NAME"),
        _int(env, "DSTACK_NODES_NUM", "dstack"),
    )


def from_slurm(
    env: Mapping[str, str], gpus_per_node: int, resolve: Callable[[str], str] | None = None
) -> NodeInfo:
    resolve = resolve or socket.gethostbyname
    hosts = _lines(_need(env, NODE_HOSTS_ENV, "slurm"))
    own = env.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    if own not in hosts:
        raise RlxError(
            f"slurm: this node ({own}) is not in the job's node list ({', '.join(hosts)})"
        )
    ips = []
    for host in hosts:
        try:
            ips.append(resolve(host))
        except OSError:
            raise RlxError(
                f"slurm: cannot resolve node {host!r} to an address; check the "
                "cluster's DNS or /etc/hosts"
            ) from None
    return _checked(
        "slurm", hosts.index(own), tuple(ips), hosts, gpus_per_node, env.get("SLURM_JOB_ID")
    )


def primary_ip() -> str:
    """The address of the interface holding the default route (what Ray itself picks: it
    does not accept 127.0.0.1 as a node address when the machine has another)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("8.8.8.8", 53))  # a routing lookup only: UDP connect sends nothing
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def from_local(gpus_per_node: int) -> NodeInfo:
    ip = primary_ip()
    return NodeInfo("local", 0, (ip,), ("localhost",), gpus_per_node, None)


# Whose environment a node reads: backend -> reader(env, the recipe's GPUs per node).
READERS: dict[str, Callable[[Mapping[str, str], int], NodeInfo]] = {
    "sky": lambda env, gpus: from_sky(env),
    "dstack": lambda env, gpus: from_dstack(env),
    "slurm": lambda env, gpus: from_slurm(env, gpus),
    "local": lambda env, gpus: from_local(gpus),
}


def resolve_waiting(
    host: str,
    seconds: float = RESOLVE_SECONDS,
    resolve: Callable[[str], str] = socket.gethostbyname,
    sleep: Callable[[float], None] = time.sleep,
) -> str:
    """The address of `host`, asking again for up to `seconds` while it does not resolve."""
    waited, delay = 0.0, 0.5
    while True:
        try:
            return resolve(host)
        except OSError:
            if waited >= seconds:
                raise RlxError(
                    f"cannot resolve node {host!r} to an address within {seconds:.0f} s; "
                    "check the cluster's DNS or /etc/hosts"
                ) from None
        sleep(delay)
        waited += delay
        delay = min(delay * 2, 5.0)


def _grouped(info: NodeInfo, resources: Resources, rank_gpus: int | None = None) -> NodeInfo:
    """`info` (ranks over the whole job, training nodes first) with each node's group and
    GPUs from the recipe; rank_gpus: this node's GPUs where the backend says."""
    groups = [(name, group) for name, group in resources.node_groups()]
    names = tuple(name for name, group in groups for _ in range(group.nodes))
    gpus = tuple(group.gpus_per_node for _, group in groups for _ in range(group.nodes))
    if len(names) != info.num_nodes:
        raise RlxError(
            f"{info.backend}: the recipe's groups have {len(names)} nodes but the job has "
            f"{info.num_nodes}; render and launch the job again from the recipe"
        )
    own = gpus[info.rank] if rank_gpus is None else rank_gpus
    return replace(info, gpus_per_node=own, groups=names, node_gpus=gpus)


def sky_group_info(
    env: Mapping[str, str],
    resources: Resources,
    resolve: Callable[[str], str] = resolve_waiting,
) -> NodeInfo:
    """A node of a SkyPilot job group: its own job's nodes from SkyPilot's variables, the
    other group's by the hostnames SkyPilot gives the job group's nodes."""
    group = _need(env, NODE_GROUP_ENV, "sky")
    job_group = _need(env, SKY_JOB_GROUP_ENV, "sky")
    own = from_sky(env)
    ips: list[str] = []
    names: list[str] = []
    offset = None
    for name, spec in resources.node_groups():
        hosts = [f"{name}-{i}.{job_group}" for i in range(spec.nodes)]
        if name == group:
            if own.num_nodes != spec.nodes:
                raise RlxError(
                    f"sky: job {name} has {own.num_nodes} nodes but the recipe's "
                    f"groups.{name} has {spec.nodes}; render and launch the job again"
                )
            offset = len(ips)
            ips += own.node_ips
        else:
            ips += [resolve(host) for host in hosts]
        names += hosts
    if offset is None:
        raise RlxError(
            f"{NODE_GROUP_ENV}={group!r} names no group of the recipe; write one of "
            f"{', '.join(name for name, _ in resources.node_groups())}"
        )
    info = NodeInfo("sky", offset + own.rank, tuple(ips), tuple(names), 0, own.run_id)
    return _grouped(info, resources, own.gpus_per_node)


def job_node_info(backend: str, env: Mapping[str, str], resources: Resources) -> NodeInfo:
    """This node, for a job of `resources`: node_info, and with resources.groups each
    node's group (the local backend has one machine and refuses groups)."""
    if resources.groups is None:
        return node_info(backend, env, resources.gpus_per_node)
    if backend == "auto":
        backend = detect_backend(env)
    if backend == "sky":
        return sky_group_info(env, resources)
    if backend == "dstack":
        info = from_dstack(env)
        return _grouped(info, resources, info.gpus_per_node)
    if backend == "slurm":
        return _grouped(from_slurm(env, 0), resources)
    raise RlxError(
        f"resources.groups asks for training and rollout machines of their own, and the "
        f"{backend} backend has one machine; launch with --backend sky, dstack or slurm, or "
        "drop groups (resources.nodes, resources.accelerators) to run here"
    )


def node_info(backend: str, env: Mapping[str, str], gpus_per_node: int) -> NodeInfo:
    """`gpus_per_node` (from the recipe) is used where the backend does not say."""
    if backend == "auto":
        backend = detect_backend(env)
    if backend not in READERS:
        raise RlxError(f"unknown backend {backend!r}; choose auto, {', '.join(READERS)}")
    return READERS[backend](env, gpus_per_node)


@contextlib.contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    """values in os.environ for the block, as a node would have them (a job's env and
    secrets for a run here; the processes started in the block, Ray's nodes and workers
    among them, inherit them); what was there before comes back after."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old
