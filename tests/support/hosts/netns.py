"""Emulated hosts on one Linux machine, for real multi-node runs.

Each host is a network namespace joined to a bridge in the root namespace by a veth pair
(own IP, default route via the bridge), plus private mount, PID, UTS and IPC namespaces
held open by a small PID 1 (hostinit.py): its own hostname, /tmp/ray, /dev/shm, /etc/hosts
and process table. The rest of the filesystem is shared, like an NFS home on a cluster.
Ownership of names and subnets, and sweeping what a crashed session left, is in slots.py.
"""

from __future__ import annotations

import atexit
import os
import re
import select
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from tests.support.hosts import slots
from tests.support.hosts.procs import (
    HostProcess,
    HostProcessInfo,
    HostsError,
    child_pids,
    kill,
    processes_in_pid_namespace,
    wait_until,
)

if TYPE_CHECKING:
    from typing import Self

INIT_SCRIPT = Path(__file__).with_name("hostinit.py")
MAX_HOSTS = 200  # host k (1-based) gets 10.77.S.(10 + k)
REQUIRED_TOOLS = ("ip", "nsenter", "unshare", "setpriv", "mount")
DEFAULT_PREFIX = "rlx"
# Nothing listens on the hosts' loopback port 53, so a lookup /etc/hosts cannot answer
# fails at once (like a cluster with no DNS) instead of waiting on an unreachable server.
RESOLV_CONF = "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n"

Command = Sequence[str] | str


class HostsUnavailable(RuntimeError):
    """This machine cannot emulate hosts (not root, tools or kernel features missing)."""


def unavailable_reason() -> str | None:
    """Why emulated hosts cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "emulated hosts need root (network, mount and PID namespaces)"
    missing = [tool for tool in REQUIRED_TOOLS if shutil.which(tool) is None]
    if missing:
        return (
            f"emulated hosts need {', '.join(missing)} (iproute2, util-linux): "
            "run .ci/setup-system as root"
        )
    probe = subprocess.run(["ip", "netns", "list"], check=False, capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns` is unavailable here: {probe.stderr.strip()}"
    # Root in a container without CAP_SYS_ADMIN passes the checks above but cannot do this.
    probe = subprocess.run(
        [
            "unshare",
            "--net",
            "--mount",
            "--pid",
            "--uts",
            "--ipc",
            "--fork",
            "--mount-proc",
            "true",
        ],
        check=False,
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        return f"cannot create namespaces here: {probe.stderr.strip()}"
    return None


class Host:
    """One emulated host: `name` is node<k>, `rank` is k-1 (the head is rank 0)."""

    def __init__(self, *, rank: int, name: str, ip: str, netns: str, init_pid: int) -> None:
        self.rank = rank
        self.name = name
        self.ip = ip
        self.netns = netns
        self.init_pid = init_pid  # PID 1 of the host, as the root namespace numbers it
        self._pid_ns = os.readlink(f"/proc/{init_pid}/ns/pid")

    def __repr__(self) -> str:
        return f"Host({self.name}, {self.ip}, init_pid={self.init_pid})"

    def enter_argv(self, cwd: str | os.PathLike[str] | None = None) -> list[str]:
        """The nsenter prefix that runs a command on this host (in `cwd`, default ours)."""
        workdir = os.fspath(cwd) if cwd is not None else os.getcwd()
        return [
            "nsenter",
            f"--target={self.init_pid}",
            "--net",
            "--mount",  # the host's /tmp/ray, /dev/shm, /etc/hosts and its own /proc
            "--uts",
            "--ipc",
            "--pid",  # nsenter forks, so the command is born inside the host's PID namespace
            f"--wdns={workdir}",
            "--",
        ]

    def popen(
        self,
        cmd: Command,
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        stdin: int | IO[Any] | None = subprocess.DEVNULL,
        stdout: int | IO[Any] | None = None,
        stderr: int | IO[Any] | None = None,
        text: bool = False,
    ) -> HostProcess:
        """Start `cmd` on this host.

        A string runs under `bash -c`. `env` is laid over this process's environment (the
        backend's variables on top of what the test runner has), it does not replace it.
        """
        argv = ["bash", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        return HostProcess(
            [*self.enter_argv(cwd), *argv],
            env={**os.environ, **(env or {})},
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            text=text,
        )

    def run(
        self,
        cmd: Command,
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        input: str | None = None,
        timeout: float = 120.0,
        check: bool = False,
    ) -> subprocess.CompletedProcess[str]:
        """Run `cmd` on this host to completion, capturing text output.

        On timeout the command and its descendants are killed and TimeoutExpired is raised;
        with check=True a non-zero exit raises HostsError carrying both outputs.
        """
        stdin = subprocess.PIPE if input is not None else subprocess.DEVNULL
        pipe = subprocess.PIPE
        with self.popen(
            cmd, env=env, cwd=cwd, stdin=stdin, stdout=pipe, stderr=pipe, text=True
        ) as proc:
            try:
                out, err = proc.communicate(input, timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill_tree()
                out, err = proc.communicate()
                raise subprocess.TimeoutExpired(proc.args, timeout, out, err) from None
        if check and proc.returncode != 0:
            raise HostsError(
                f"{self.name}: {cmd!r} exited {proc.returncode}\nstdout:\n{out}\nstderr:\n{err}"
            )
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def processes(self) -> list[HostProcessInfo]:
        """Every process on this host except its PID 1."""
        return processes_in_pid_namespace(self._pid_ns, exclude=self.init_pid)

    def kill_all(self, timeout: float = 10.0) -> None:
        """SIGKILL every process on this host; the host itself stays up."""

        def nothing_left() -> bool:
            alive = self.processes()
            for proc in alive:
                kill(proc.pid)
            return not alive

        wait_until(nothing_left, timeout, f"the processes on {self.name} to die")


def _hosts_file(names: slots.SlotNames, count: int) -> str:
    lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
    # This machine answers at the bridge address, as a login or controller node would.
    lines.append(f"{names.bridge_ip} {os.uname().nodename}")
    lines += [f"{names.host_ip(rank)} node{rank + 1}" for rank in range(count)]
    return "\n".join(lines) + "\n"


def _holder_argv(names: slots.SlotNames, rank: int) -> list[str]:
    return [
        # If the test runner dies, so do the hosts and everything on them.
        "setpriv",
        "--pdeathsig",
        "KILL",
        "--",
        # nsenter rather than `ip netns exec`, which would remount /sys and hide cgroups.
        "nsenter",
        f"--net={slots.NETNS_DIR / names.netns(rank)}",
        "--",
        "unshare",
        "--mount",
        "--pid",
        "--uts",
        "--ipc",
        "--fork",
        "--mount-proc",
        "--propagation",
        "private",
        "--kill-child",
        "--",
        sys.executable,
        str(INIT_SCRIPT),
        "--hostname",
        f"node{rank + 1}",
        "--hosts-file",
        str(names.state_dir / "hosts"),
        "--resolv-file",
        str(names.state_dir / "resolv.conf"),
    ]


class Hosts(Sequence[Host]):
    """N emulated hosts: hosts[0] is node1 (rank 0, the head), hosts[i] is node<i+1>.

    Make them with Hosts.create(n), best as a context manager; close() kills every process
    on every host and removes the namespaces, links and state. The hosts die with the
    thread that made them (parent-death signal), so create them from the main thread.
    """

    def __init__(self, names: slots.SlotNames, lock_fd: int) -> None:
        self._names = names
        self._lock_fd: int | None = lock_fd
        self._hosts: list[Host] = []
        self._holders: list[subprocess.Popen[bytes]] = []  # one `unshare` per host
        self._count = 0

    @classmethod
    def create(cls, n: int, *, prefix: str = DEFAULT_PREFIX, ready_timeout: float = 30.0) -> Hosts:
        """Sweep litter of crashed runs, claim a free slot and bring up `n` hosts."""
        reason = unavailable_reason()
        if reason is not None:
            raise HostsUnavailable(reason)
        if not re.fullmatch(r"[a-z]{1,5}", prefix):
            raise ValueError(f"prefix must be 1-5 lowercase letters, got {prefix!r}")
        if not 1 <= n <= MAX_HOSTS:
            raise ValueError(f"n must be between 1 and {MAX_HOSTS}, got {n}")
        slots.sweep_stale(prefix)
        hosts = cls(*slots.claim_free_slot(prefix))
        atexit.register(hosts.close)
        try:
            hosts._build(n, ready_timeout)
        except BaseException:
            hosts.close()
            raise
        return hosts

    def _build(self, n: int, ready_timeout: float) -> None:
        names = self._names
        self._count = n
        names.state_dir.mkdir(parents=True, exist_ok=True)
        (names.state_dir / "hosts").write_text(_hosts_file(names, n))
        (names.state_dir / "resolv.conf").write_text(RESOLV_CONF)
        slots.ip("link", "add", names.bridge, "type", "bridge")
        slots.ip("addr", "add", f"{names.bridge_ip}/24", "dev", names.bridge)
        slots.ip("link", "set", names.bridge, "up")
        slots.allow_bridge_forwarding(names)
        for rank in range(n):
            netns, veth = names.netns(rank), names.veth(rank)
            slots.ip("netns", "add", netns)
            slots.ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
            slots.ip("link", "set", veth, "master", names.bridge, "up")
            slots.ip("-n", netns, "addr", "add", f"{names.host_ip(rank)}/24", "dev", "eth0")
            slots.ip("-n", netns, "link", "set", "eth0", "up")
            slots.ip("-n", netns, "link", "set", "lo", "up")
            slots.ip("-n", netns, "route", "add", "default", "via", names.bridge_ip)
        for rank in range(n):
            with open(names.state_dir / f"node{rank + 1}.init.log", "wb") as log:
                self._holders.append(
                    subprocess.Popen(
                        _holder_argv(names, rank),
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.PIPE,
                        stderr=log,
                    )
                )
        deadline = time.monotonic() + ready_timeout
        for rank, holder in enumerate(self._holders):
            init_pid = self._await_ready(rank, holder, deadline)
            self._hosts.append(
                Host(
                    rank=rank,
                    name=f"node{rank + 1}",
                    ip=names.host_ip(rank),
                    netns=names.netns(rank),
                    init_pid=init_pid,
                )
            )

    def _await_ready(self, rank: int, holder: subprocess.Popen[bytes], deadline: float) -> int:
        """Wait for node<rank+1>'s init to say "ready"; return its PID."""
        assert holder.stdout is not None
        remaining = max(deadline - time.monotonic(), 0.0)
        readable, _, _ = select.select([holder.stdout], [], [], remaining)
        line = holder.stdout.readline() if readable else b""
        holder.stdout.close()
        children = child_pids(holder.pid)
        if line.strip() != b"ready" or len(children) != 1:
            log = (self._names.state_dir / f"node{rank + 1}.init.log").read_text()
            raise HostsError(f"node{rank + 1} did not come up (exit {holder.poll()}):\n{log}")
        return children[0]

    def __getitem__(self, index: int) -> Host:  # type: ignore[override]
        return self._hosts[index]

    def __len__(self) -> int:
        return len(self._hosts)

    def __iter__(self) -> Iterator[Host]:
        return iter(self._hosts)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def bridge(self) -> str:
        return self._names.bridge

    @property
    def bridge_ip(self) -> str:
        """This machine's address as the hosts see it (their login or controller node)."""
        return self._names.bridge_ip

    @property
    def slot(self) -> int:
        return self._names.slot

    @property
    def state_dir(self) -> Path:
        """Scratch space of these hosts, removed by close() and by the sweep after a crash."""
        return self._names.state_dir

    @property
    def ips(self) -> list[str]:
        return [host.ip for host in self._hosts]

    @property
    def names(self) -> list[str]:
        return [host.name for host in self._hosts]

    @property
    def closed(self) -> bool:
        return self._lock_fd is None

    def register_daemon(self, pid: int) -> None:
        """Tie a process of the root namespace to these hosts: close() (or the sweep) kills it."""
        slots.register_daemon(self._names, pid)

    def close(self) -> None:
        """Kill everything on every host, remove namespaces, links and state. Idempotent."""
        if self._lock_fd is None:
            return
        atexit.unregister(self.close)
        for host in self._hosts:
            # Killing PID 1 of a PID namespace kills every process in it; its unshare
            # parent returns once the namespace is empty.
            kill(host.init_pid)
        for holder in self._holders[len(self._hosts) :]:
            holder.kill()  # never came up: --kill-child takes its init down with it
        for holder in self._holders:
            try:
                holder.wait(timeout=30)
            except subprocess.TimeoutExpired:
                holder.kill()
                holder.wait()
        slots.teardown(self._names, range(self._count))
        slots.release(self._names, self._lock_fd)
        self._lock_fd = None
