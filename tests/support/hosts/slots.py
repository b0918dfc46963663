"""Slots: who owns which bridge, namespaces, subnet and state, and sweeping dead owners.

A slot is a number S; its resources are named after a prefix and S (bridge <p>brS, netns
<p>hS-K, veth <p>vS-K, subnet 10.77.S.0/24, state dir STATE_ROOT/<p>-slotS). A session owns
slot S while it holds an flock on STATE_ROOT/slotS.lock; the kernel drops the lock when the
session dies however it dies, so resources of a slot whose lock is free are litter.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tests.support.hosts.procs import HostsError, kill, start_time

STATE_ROOT = Path("/run/rlx-hosts")
NETNS_DIR = Path("/run/netns")
SUBNET_BASE = "10.77"
MAX_SLOTS = 64


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], check=False, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise HostsError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")
    return done


@dataclass(frozen=True)
class SlotNames:
    prefix: str
    slot: int

    @property
    def bridge(self) -> str:
        return f"{self.prefix}br{self.slot}"

    @property
    def bridge_ip(self) -> str:
        return f"{SUBNET_BASE}.{self.slot}.1"

    @property
    def subnet(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(f"{SUBNET_BASE}.{self.slot}.0/24")

    @property
    def lock_path(self) -> Path:
        # One lock per subnet whatever the prefix: two prefixes must not share 10.77.S.
        return STATE_ROOT / f"slot{self.slot}.lock"

    @property
    def state_dir(self) -> Path:
        return STATE_ROOT / f"{self.prefix}-slot{self.slot}"

    def netns(self, rank: int) -> str:
        return f"{self.prefix}h{self.slot}-{rank + 1}"

    def veth(self, rank: int) -> str:
        return f"{self.prefix}v{self.slot}-{rank + 1}"

    def host_ip(self, rank: int) -> str:
        return f"{SUBNET_BASE}.{self.slot}.{11 + rank}"


def try_lock(path: Path) -> int | None:
    """An fd holding an exclusive flock on `path`, or None when someone else holds it."""
    while True:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except FileNotFoundError:
            continue  # the directory went away between mkdir and open
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            same_file = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same_file = False
        if same_file:
            return fd
        os.close(fd)  # its owner unlinked it after we opened it: lock the new one


def release(names: SlotNames, fd: int) -> None:
    """Give a slot up; unlink first, so nobody can lock the old file after we let go."""
    names.lock_path.unlink(missing_ok=True)
    os.close(fd)
    with contextlib.suppress(OSError):
        STATE_ROOT.rmdir()  # only when no other slot is in use; try_lock recreates it


def claim_free_slot(prefix: str) -> tuple[SlotNames, int]:
    used = _addresses()
    for slot in range(MAX_SLOTS):
        names = SlotNames(prefix, slot)
        # A slot whose subnet is on a link is never locked, not even for a moment: its lock
        # may be free because a crashed run left it, and the sweep of that run's prefix must
        # find the lock free to tear its litter down (a probe here made it skip the slot).
        if any(addr in names.subnet for addr in used):
            continue
        fd = try_lock(names.lock_path)
        if fd is None:
            continue
        if _subnet_in_use(names.subnet):
            release(names, fd)  # a link took that subnet since we looked
            continue
        return names, fd
    raise HostsError(f"all {MAX_SLOTS} slots for prefix {prefix!r} are in use")


def _addresses() -> list[ipaddress.IPv4Address]:
    """Every IPv4 address on a link of this (root) namespace."""
    return [
        ipaddress.IPv4Address(addr["local"])
        for link in json.loads(ip("-json", "addr", "show").stdout or "[]")
        for addr in link.get("addr_info", [])
        if addr.get("family") == "inet"
    ]


def _subnet_in_use(subnet: ipaddress.IPv4Network) -> bool:
    return any(addr in subnet for addr in _addresses())


def _bridged_traffic_filtered() -> bool:
    try:
        return Path("/proc/sys/net/bridge/bridge-nf-call-iptables").read_text().strip() == "1"
    except FileNotFoundError:
        return False  # br_netfilter not loaded: bridged frames skip iptables entirely


def _forward_rule(names: SlotNames) -> list[str]:
    return ["FORWARD", "-i", names.bridge, "-o", names.bridge, "-j", "ACCEPT"]


def allow_bridge_forwarding(names: SlotNames) -> None:
    """Let hosts talk to each other where bridged traffic goes through iptables.

    With br_netfilter loaded, frames between two ports of our bridge traverse the FORWARD
    chain, whose policy is DROP on machines running Docker. One rule, scoped to our bridge,
    lets them through; teardown removes it.
    """
    if shutil.which("iptables") is None or not _bridged_traffic_filtered():
        return
    done = subprocess.run(
        ["iptables", "-w", "-I", *_forward_rule(names)], check=False, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise HostsError(f"iptables could not allow traffic on {names.bridge}: {done.stderr}")


def _drop_bridge_forwarding(names: SlotNames) -> None:
    if shutil.which("iptables") is None:
        return
    for _ in range(16):  # one per rule we may have inserted; stops at the first miss
        done = subprocess.run(
            ["iptables", "-w", "-D", *_forward_rule(names)], check=False, capture_output=True
        )
        if done.returncode != 0:
            return


def register_daemon(names: SlotNames, pid: int) -> None:
    """Tie a root-namespace process to a slot so that teardown and the sweep kill it."""
    started = start_time(pid)
    if started is None:
        raise HostsError(f"process {pid} is not running")
    with open(names.state_dir / "daemons", "a") as registry:
        registry.write(f"{pid} {started}\n")


def _kill_daemons(state_dir: Path) -> None:
    try:
        lines = (state_dir / "daemons").read_text().split("\n")
    except FileNotFoundError:
        return
    for line in filter(None, lines):
        pid, started = line.split()
        # The start time guards against a recycled PID now naming someone else's process.
        if start_time(int(pid)) == started:
            kill(int(pid))


def teardown(names: SlotNames, ranks: Iterable[int]) -> None:
    """Remove what a slot has (we hold its lock); tolerant of half-built or half-gone state."""
    _kill_daemons(names.state_dir)
    for rank in ranks:
        netns = names.netns(rank)
        if (NETNS_DIR / netns).exists():
            # Only processes inside our own namespace are ours to kill.
            for pid in ip("netns", "pids", netns, check=False).stdout.split():
                kill(int(pid))
            ip("netns", "delete", netns, check=False)
        ip("link", "delete", names.veth(rank), check=False)
    ip("link", "delete", names.bridge, check=False)
    _drop_bridge_forwarding(names)
    shutil.rmtree(names.state_dir, ignore_errors=True)


def _netns_names() -> list[str]:
    if not NETNS_DIR.is_dir():
        return []
    return sorted(entry.name for entry in NETNS_DIR.iterdir())


def _link_names() -> list[str]:
    return [link["ifname"] for link in json.loads(ip("-json", "link", "show").stdout or "[]")]


def sweep_stale(prefix: str) -> list[str]:
    """Tear down every slot of `prefix` that has resources but no live owner.

    Returns the namespaces and links it removed.
    """
    pattern = re.compile(rf"^{re.escape(prefix)}(?:h|v|br)(\d+)(?:-(\d+))?$")
    state_pattern = re.compile(rf"^{re.escape(prefix)}-slot(\d+)$")
    ranks: dict[int, set[int]] = {}
    named: dict[int, list[str]] = {}
    for name in [*_netns_names(), *_link_names()]:
        match = pattern.match(name)
        if match:
            slot = int(match[1])
            named.setdefault(slot, []).append(name)
            ranks.setdefault(slot, set())
            if match[2] is not None:
                ranks[slot].add(int(match[2]) - 1)
    if STATE_ROOT.is_dir():
        for entry in STATE_ROOT.iterdir():
            match = state_pattern.match(entry.name)
            if match:
                ranks.setdefault(int(match[1]), set())
    swept: list[str] = []
    for slot, slot_ranks in sorted(ranks.items()):
        names = SlotNames(prefix, slot)
        fd = try_lock(names.lock_path)
        if fd is None:
            continue  # a live session owns it
        teardown(names, sorted(slot_ranks))
        release(names, fd)
        swept.extend(named.get(slot, []))
    return swept
