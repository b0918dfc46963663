"""Checks of the job's Ray cluster: its ports against the backends' own and the internet, the
dashboard's address, token auth, the debugger, and setup commands that would fight rlx's Ray."""

from __future__ import annotations

import re
from collections.abc import Iterator

from rlx.launchers import specs
from rlx.lint.core import ERROR, WARNING, Check, Problem
from rlx.recipe import Recipe


# Ports SkyPilot's own Ray holds on every node of a SkyPilot cluster.
def _ray_ports(recipe: Recipe) -> dict[str, int]:
    ray = recipe.ray
    return {
        "port": ray.port,
        "dashboard_port": ray.dashboard_port,
        "dashboard_agent_port": ray.dashboard_agent_port,
        "object_manager_port": ray.object_manager_port,
        "node_manager_port": ray.node_manager_port,
        "client_server_port": ray.client_server_port,
    }


def check_ray_ports(recipe: Recipe) -> Iterator[Problem]:
    ports = _ray_ports(recipe)
    worker_range = range(recipe.ray.min_worker_port, recipe.ray.max_worker_port + 1)
    if not worker_range:
        yield Problem(
            ("ray", "max_worker_port"), ERROR, "max_worker_port must be above min_worker_port"
        )
    seen: dict[int, str] = {}
    held = [b for b in specs() if b.ray_ports or b.ray_worker_ports]
    for field, port in ports.items():
        for backend in held:
            workers = backend.ray_worker_ports or range(0)
            if port in backend.ray_ports:
                yield Problem(
                    ("ray", field),
                    ERROR,
                    f"port {port} is {backend.ray_ports[port]} on every {backend.title} node; "
                    "pick another port",
                )
            elif port in workers:
                yield Problem(
                    ("ray", field),
                    ERROR,
                    f"port {port} is in {backend.title}'s Ray worker range "
                    f"{workers.start}-{workers.stop - 1}; pick a port outside it",
                )
        if port in seen:
            yield Problem(
                ("ray", field),
                ERROR,
                f"port {port} is also ray.{seen[port]}; every Ray port must differ",
            )
        seen.setdefault(port, field)
        if port in worker_range:
            yield Problem(
                ("ray", field),
                ERROR,
                f"port {port} lies inside the worker port range "
                f"{worker_range.start}-{worker_range.stop - 1}",
            )
    for backend in held:
        workers = backend.ray_worker_ports or range(0)
        if set(worker_range) & set(workers):
            yield Problem(
                ("ray", "min_worker_port"),
                ERROR,
                f"the worker port range overlaps {backend.title}'s Ray workers "
                f"({workers.start}-{workers.stop - 1})",
            )


def check_public_ports(recipe: Recipe) -> Iterator[Problem]:
    public = set(recipe.resources.expanded_ports())
    ray_ports = _ray_ports(recipe)
    for field, port in ray_ports.items():
        if port in public:
            yield Problem(
                ("resources", "ports"),
                ERROR,
                f"ray.{field} {port} is opened to the internet; anyone could join "
                "the cluster or submit jobs. Remove it and use an SSH tunnel",
            )
    ray = recipe.ray
    if public & set(range(ray.min_worker_port, ray.max_worker_port + 1)):
        yield Problem(
            ("resources", "ports"),
            ERROR,
            "a public port lies in Ray's worker port range; remove it",
        )


def check_dashboard_host(recipe: Recipe) -> Iterator[Problem]:
    host = recipe.ray.dashboard_host
    if host in ("0.0.0.0", "::", "[::]", "*"):
        yield Problem(
            ("ray", "dashboard_host"),
            ERROR,
            f"{host} opens the Ray dashboard (and job submission) to the network; "
            "keep 127.0.0.1 and use an SSH tunnel",
        )
    elif host not in ("127.0.0.1", "localhost", "::1"):
        yield Problem(
            ("ray", "dashboard_host"),
            WARNING,
            f"the dashboard binds {host}, reachable from other machines; 127.0.0.1 is safer",
        )


def check_auth(recipe: Recipe) -> Iterator[Problem]:
    if recipe.ray.auth == "none":
        yield Problem(
            ("ray", "auth"),
            WARNING,
            "without token auth anyone who reaches the head's Ray port can join "
            "the cluster and run code; keep auth: token unless the network is "
            "private",
        )


def check_debugger(recipe: Recipe) -> Iterator[Problem]:
    if recipe.ray.debug == "legacy":
        yield Problem(
            ("ray", "debug"),
            WARNING,
            "legacy starts Ray with --ray-debugger-external: a paused task's pdb listens on "
            "the node's address, unauthenticated, for anyone who reaches it; use "
            "post-mortem or breakpoints (debugpy, reached through the dashboard) unless a "
            "firewall closes the nodes",
        )


def check_setup_commands(recipe: Recipe) -> Iterator[Problem]:
    for i, command in enumerate(recipe.setup):
        if re.search(r"\bray\s+stop\b", command):
            yield Problem(
                ("setup", i),
                ERROR,
                "'ray stop' stops every Ray on the node, "
                "SkyPilot's own included; rlx stops only the cluster it started",
            )
        elif re.search(r"\bray\s+start\b", command):
            yield Problem(
                ("setup", i),
                WARNING,
                "rlx starts and joins the Ray cluster "
                "itself; a 'ray start' in setup will clash with it",
            )


CHECKS: list[Check] = [
    check_ray_ports,
    check_public_ports,
    check_dashboard_host,
    check_auth,
    check_debugger,
    check_setup_commands,
]
