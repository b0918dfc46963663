"""The Ray side of the bootstrap: start, watch and stop the job's own Ray on one node.

Everything that touches Ray internals lives here, and the tests exercise it against the
installed Ray. We never call `ray stop` (it would also stop SkyPilot's own Ray on the node):
our processes are the ones whose command line names our GCS address, plus their children.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from rlx import procfs, sigterm
from rlx.errors import RlxError
from rlx.node.env import NODE_GROUP_LABEL
from rlx.recipe.model import RaySettings

NAMESPACE = b"rlx"
STATE_KEY = b"state"  # "waiting" -> "running" -> "done:<exit code>"
ATTEMPT_KEY = b"attempt"  # a fresh nonce per head start: tells a restarted head apart
ACK_PREFIX = b"ack:"  # one per worker once it has seen "done"
# Written by the head's `ray start` right after its GCS is up; workers read it when joining.
SESSION_NAMESPACE = b"session"
SESSION_KEY = b"session_name"

# How long a GcsClient waits for its GCS when created (Ray's config name; default 30 s).
GCS_CONNECT_TIMEOUT_ENV = "RAY_py_gcs_connect_timeout_s"

# GCS health checks: a killed raylet is declared dead after about period x threshold.
FAST_FAILURE_ENV = {
    "RAY_health_check_initial_delay_ms": "2000",
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "2000",
    "RAY_health_check_failure_threshold": "5",
}
# rlx places every actor it needs itself; the idle workers Ray starts by default when the
# first driver connects (one per CPU of the node, each a Python process importing Ray) are never
# used: off.
NO_PRESTART_ENV = {"RAY_prestart_worker_first_driver": "0"}


@dataclass(frozen=True)
class NodeState:
    ip: str
    alive: bool
    gpus: float
    cpus: float = 0.0
    group: str | None = None  # its NODE_GROUP_LABEL (resources.groups)


# Ray's debugger switches (ray.debug), set on every node's Ray, so every worker inherits them.
DEBUG_ENV: dict[str, dict[str, str]] = {
    "off": {},
    "post-mortem": {"RAY_DEBUG": "1", "RAY_DEBUG_POST_MORTEM": "1"},
    "breakpoints": {"RAY_DEBUG": "1"},
    "legacy": {"RAY_DEBUG": "legacy"},
}


def ray_env(base: Mapping[str, str], token: str | None, debug: str = "off") -> dict[str, str]:
    """Environment for Ray processes and clients of this job."""
    env = dict(base)
    env.update(DEBUG_ENV[debug])
    env.pop("RAY_ADDRESS", None)  # never let a stray address point us at another cluster
    # The token comes from the job alone, never from a file on the node.
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    env.pop("RAY_AUTH_TOKEN", None)
    if token:
        env["RAY_AUTH_MODE"] = "token"
        env["RAY_AUTH_TOKEN"] = token
    else:
        # Explicit: with the mode unset, Ray turns token auth on by itself wherever a
        # ~/.ray/auth_token exists (any earlier local `ray.init()` leaves one), and then
        # our own clients, which have no token, are refused.
        env["RAY_AUTH_MODE"] = "disabled"
    env.update(FAST_FAILURE_ENV)
    env.update(NO_PRESTART_ENV)
    return env


def head_command(settings: RaySettings, ip: str, gpus: int, group: str | None = None) -> list[str]:
    return [
        "ray",
        "start",
        "--head",
        f"--node-ip-address={ip}",
        f"--port={settings.port}",
        f"--dashboard-host={settings.dashboard_host}",
        f"--dashboard-port={settings.dashboard_port}",
        f"--ray-client-server-port={settings.client_server_port}",
        *_shared_flags(settings, gpus, group),
    ]


def worker_command(
    settings: RaySettings, head_ip: str, ip: str, gpus: int, group: str | None = None
) -> list[str]:
    return [
        "ray",
        "start",
        f"--address={head_ip}:{settings.port}",
        f"--node-ip-address={ip}",
        *_shared_flags(settings, gpus, group),
    ]


def _shared_flags(settings: RaySettings, gpus: int, group: str | None) -> list[str]:
    return [
        # resources.groups: the node's group as a Ray label, which placement selects by
        *([f"--labels={NODE_GROUP_LABEL}={group}"] if group else []),
        f"--dashboard-agent-listen-port={settings.dashboard_agent_port}",
        f"--object-manager-port={settings.object_manager_port}",
        f"--node-manager-port={settings.node_manager_port}",
        f"--min-worker-port={settings.min_worker_port}",
        f"--max-worker-port={settings.max_worker_port}",
        f"--num-gpus={gpus}",
        "--disable-usage-stats",
        # Legacy pdb sessions listen on the node's address instead of localhost.
        *(["--ray-debugger-external"] if settings.debug == "legacy" else []),
    ]


# What `ray start` says when a raylet did not register with the GCS within its fixed 30 s
# (ray/_private/node.py), though the raylet may still be starting.
RAYLET_SLOW = "timed out during startup"
# What a worker's `ray start` says when the head's own node is not in the GCS (yet).
HEAD_NODE_MISSING = "No node info found for head node"


def _ray_start_error(argv: list[str], code: int, output: str) -> RlxError:
    tail = "\n".join(output.strip().splitlines()[-15:])
    return RlxError(f"`{' '.join(argv[:3])}` failed (exit {code}):\n{tail}")


def _not_installed() -> RlxError:
    return RlxError(
        "the 'ray' command is not installed on this node; add "
        "pip install 'rlx[node]' (or ray[default]) to setup"
    )


def launch_argv(argv: list[str]) -> list[str]:
    """How `ray ...` is run: through rlx.node.raystart in this interpreter where it has Ray
    (the Ray the trainer imports, about 2 CPU-s cheaper to start), else the `ray` on PATH."""
    if argv[:1] == ["ray"] and importlib.util.find_spec("ray") is not None:
        return [sys.executable, "-m", "rlx.node.raystart", *argv[1:]]
    return argv


def run_ray_start(
    argv: list[str], env: Mapping[str, str], timeout: float, hold_sigterm: bool = False
) -> None:
    """Run `ray start` to the end; RlxError with the tail of its output if it fails."""
    start = RayStart(argv, env, hold_sigterm)
    try:
        start.wait(timeout)
    finally:
        start.stop()


class RayStart:
    """`ray start` running in the background, so the caller can use the GCS as soon as it
    is up instead of waiting for every other head process (dashboard, client server).

    Its output goes to a file, not a pipe: the daemons it leaves behind could hold a pipe
    open and keep a reader waiting for the end of it. With `hold_sigterm` the daemons keep
    SIGTERM blocked (rlx.sigterm): they outlive a SIGTERM sent to every process of the node
    and stop_own_ray ends them with SIGKILL."""

    def __init__(self, argv: list[str], env: Mapping[str, str], hold_sigterm: bool = False):
        self.argv = argv
        self._output = tempfile.TemporaryFile()  # noqa: SIM115 (closed by stop())
        held = sigterm.held_by_children() if hold_sigterm else contextlib.nullcontext()
        try:
            with held:
                self._proc = subprocess.Popen(
                    launch_argv(argv), env=dict(env), stdout=self._output, stderr=subprocess.STDOUT
                )
        except FileNotFoundError:
            self._output.close()
            raise _not_installed() from None

    def check(self) -> bool:
        """True once it has finished well; raises if it failed; False while it runs."""
        code = self._proc.poll()
        if code is None:
            return False
        if code != 0:
            self._output.seek(0)
            output = self._output.read().decode(errors="replace")
            raise _ray_start_error(self.argv, code, output)
        return True

    def wait(self, timeout: float) -> None:
        try:
            self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise RlxError(
                f"`{' '.join(self.argv[:3])}` did not finish within {timeout:.0f} s"
            ) from None
        self.check()

    def stop(self) -> None:
        """Kill `ray start` itself if it still runs (not the daemons it started)."""
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._output.close()


def fixed_ports(settings: RaySettings, head: bool) -> dict[str, int]:
    """The recipe's ports our Ray listens on, on a head or a worker node, by field name."""
    ports = {
        "dashboard_agent_port": settings.dashboard_agent_port,
        "object_manager_port": settings.object_manager_port,
        "node_manager_port": settings.node_manager_port,
    }
    if head:
        ports = {
            "port": settings.port,
            "dashboard_port": settings.dashboard_port,
            "client_server_port": settings.client_server_port,
            **ports,
        }
    return ports


def taken_ports(ports: Mapping[str, int]) -> list[str]:
    """The names of `ports` something on this node already listens on."""
    taken = []
    for name, port in ports.items():
        with socket.socket() as probe:
            # SO_REUSEADDR: a port in TIME_WAIT after an earlier attempt is free to use.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("0.0.0.0", port))
            except OSError:
                taken.append(name)
    return taken


def port_open(ip: str, port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((ip, port), timeout=timeout):
            return True
    except OSError:
        return False


def preload() -> None:
    """Import Ray's GCS client ahead of need (it may be called from a thread)."""
    import ray._raylet  # noqa: F401


class Gcs:
    """A thin client of the head's GCS: node table and a small key-value store."""

    def __init__(self, address: str, timeout: float = 5.0):
        from ray._raylet import GcsClient  # heavy; only on nodes

        self.timeout = timeout
        self._client: Any = GcsClient(address=address)

    def nodes(self) -> list[NodeState]:
        info = self._client.get_all_node_info(timeout=self.timeout)
        return [
            NodeState(
                node.node_manager_address,
                node.state == 0,  # 0 is ALIVE
                float(node.resources_total.get("GPU", 0.0)),
                float(node.resources_total.get("CPU", 0.0)),
                dict(node.labels).get(NODE_GROUP_LABEL),
            )
            for node in info.values()
        ]

    def get(self, key: bytes, namespace: bytes = NAMESPACE) -> bytes | None:
        return self._client.internal_kv_get(key, namespace, timeout=self.timeout)

    def accepts_nodes(self) -> bool:
        """The head's `ray start` has registered the session: a worker's `ray start` finds
        what it needs at once (too early, and it sleeps 2 s before asking again)."""
        return self.get(SESSION_KEY, SESSION_NAMESPACE) is not None

    def put(self, key: bytes, value: bytes) -> None:
        self._client.internal_kv_put(key, value, True, NAMESPACE, timeout=self.timeout)

    def keys(self, prefix: bytes) -> list[bytes]:
        return list(self._client.internal_kv_keys(prefix, NAMESPACE, timeout=self.timeout))


# --------------------------------------------------------------------------- processes


def _is_ours(argv: list[str], address: str, port: int) -> bool:
    if not argv:
        return False
    program = os.path.basename(argv[0])
    is_ray = program in ("gcs_server", "raylet") or any(
        "/ray/" in arg or arg.startswith("ray.") for arg in argv[:3]
    )
    if not is_ray:
        return False
    return any(address in arg for arg in argv) or (
        program == "gcs_server" and f"--gcs_server_port={port}" in argv
    )


def own_ray_pids(address: str, port: int) -> list[int]:
    """Ray processes of the cluster at `address` on this node, with all their descendants."""
    parents = procfs.parents()
    roots = {pid for pid in parents if _is_ours(procfs.cmdline(pid), address, port)}
    found = set(roots)
    changed = True
    while changed:
        changed = False
        for pid, ppid in parents.items():
            if ppid in found and pid not in found:
                found.add(pid)
                changed = True
    found.discard(os.getpid())
    return sorted(found)


def raylet_alive(address: str, port: int) -> bool:
    return any(_program(pid) == "raylet" for pid in own_ray_pids(address, port))


def stop_own_ray(address: str, port: int, grace: float = 5.0) -> int:
    """Stop this job's Ray processes on this node (never anyone else's). Returns how many.

    The GCS goes last: a raylet or dashboard told to stop while the GCS is already gone
    waits for it until its own timeouts (seconds), while with the GCS still up everything
    is gone in well under a second."""
    pids = own_ray_pids(address, port)
    gcs = [pid for pid in pids if _program(pid) == "gcs_server"]
    rest = [pid for pid in pids if pid not in gcs]
    for group in (rest, gcs):
        _terminate(group, grace)
    return len(pids)


def _program(pid: int) -> str:
    return os.path.basename((procfs.cmdline(pid) or [""])[0])


def _terminate(pids: list[int], grace: float) -> None:
    """SIGTERM, then SIGKILL what is still running after `grace` seconds. A process that
    holds SIGTERM blocked (our Ray's, see rlx.sigterm) gets SIGKILL at once: a SIGTERM
    would only wait out the grace."""
    deaf = [pid for pid in pids if procfs.blocks_signal(pid, signal.SIGTERM)]
    if deaf:
        # Frozen first, with every child they have by then: a raylet killed outright leaves
        # the workers it forked a moment before (not in `pids`) running and holding the ports
        # it passed down, where a raylet told to stop would have ended them itself.
        deaf = _freeze(deaf)
        pids = sorted(set(pids) | set(deaf))
    for pid in deaf:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        for delay in backoff(start=0.01, cap=0.1):
            if not any(procfs.running(pid) for pid in pids) or time.monotonic() >= deadline:
                break
            time.sleep(delay)
        if not any(procfs.running(pid) for pid in pids):
            return


def _freeze(roots: list[int]) -> list[int]:
    """SIGSTOP `roots` and their descendants, again for any child that appears meanwhile, until
    the tree holds still; the pids stopped. (SIGSTOP cannot be blocked or caught.)"""
    stopped: set[int] = set()
    todo = set(roots)
    while todo:
        for pid in todo:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        stopped |= todo
        todo = {pid for pid, ppid in procfs.parents().items() if ppid in stopped} - stopped
    return sorted(stopped)


def backoff(start: float = 0.05, factor: float = 1.5, cap: float = 1.0) -> Iterator[float]:
    """Poll intervals: fast at first (bring-up is usually quick), then gentler."""
    delay = start
    while True:
        yield delay
        delay = min(delay * factor, cap)
