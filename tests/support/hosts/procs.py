"""Processes as /proc shows them: trees, PID namespaces, and commands run through nsenter."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class HostsError(RuntimeError):
    """Making, using or tearing down emulated hosts failed."""


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll `predicate` with backoff (5 ms up to 200 ms); HostsError naming `what` on timeout."""
    deadline = time.monotonic() + timeout
    delay = 0.005
    while not predicate():
        if time.monotonic() > deadline:
            raise HostsError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, 0.2)


def start_time(pid: int) -> str | None:
    """Start time in clock ticks since boot: with the PID, it names one process for good."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) may hold spaces and parentheses; what follows is plain.
    return stat.rsplit(")", 1)[1].split()[19]


def child_pids(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return []
    return [int(field) for field in text.split()]


def descendants(pid: int) -> list[int]:
    found: list[int] = []
    pending = [pid]
    while pending:
        children = child_pids(pending.pop())
        found.extend(children)
        pending.extend(children)
    return found


def kill(pid: int, sig: int = signal.SIGKILL) -> None:
    """Signal a process that may already be gone."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


@dataclass(frozen=True)
class HostProcessInfo:
    """One process running on an emulated host."""

    pid: int  # in the root PID namespace (what os.kill takes here)
    host_pid: int  # as the host itself sees it
    state: str  # R, S, Z, ... from /proc/PID/status
    cmdline: str


def processes_in_pid_namespace(pid_ns: str, exclude: int) -> list[HostProcessInfo]:
    """Every process whose PID namespace is `pid_ns` (a /proc/PID/ns/pid link), but `exclude`."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == exclude:
            continue
        pid = int(entry.name)
        try:
            if os.readlink(f"/proc/{pid}/ns/pid") != pid_ns:
                continue
            status = Path(f"/proc/{pid}/status").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # it exited while we looked, or is not ours to inspect
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        found.append(
            HostProcessInfo(
                pid=pid,
                host_pid=int(fields["NSpid"].split()[-1]),
                state=fields["State"].split()[0],
                cmdline=cmdline.replace(b"\0", b" ").decode(errors="replace").strip(),
            )
        )
    return found


class HostProcess(subprocess.Popen[Any]):
    """A command running on a host.

    `pid` is the nsenter process that entered the host's namespaces. It relays the
    command's exit status but not signals, so send_signal/terminate/kill go to the command
    itself (`inner_pid`).
    """

    _inner: int | None = None

    @property
    def inner_pid(self) -> int | None:
        """PID (root namespace) of the command itself; None if it ended before we saw it."""
        if self._inner is None:
            deadline = time.monotonic() + 5.0
            # nsenter forks right after entering the namespaces: this wait is short.
            while self._inner is None and self.poll() is None and time.monotonic() < deadline:
                children = child_pids(self.pid)
                if children:
                    self._inner = children[0]
                else:
                    time.sleep(0.002)
        return self._inner

    def send_signal(self, sig: int) -> None:
        self.poll()
        if self.returncode is not None:
            return
        target = self.inner_pid
        kill(target if target is not None else self.pid, sig)

    def kill_tree(self) -> None:
        """SIGKILL the command and everything it started (children may hold its pipes)."""
        self.poll()
        if self.returncode is not None:
            return
        target = self.inner_pid
        if target is None:
            return
        for pid in [target, *descendants(target)]:
            kill(pid)
