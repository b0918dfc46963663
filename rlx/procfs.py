"""Linux /proc, read in one place: a process's command line, state, parent and memory.

Every reader answers "gone" (an empty list, None, False, 0) for a process that exited while
it was read: callers list processes and then read them, and some always exit in between.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

PROC = Path("/proc")


def _stat_fields(pid: int | str) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first). The name sits in
    parentheses and may hold spaces and parentheses itself: split after the last ')'."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()


def pids() -> list[int]:
    return [int(entry) for entry in os.listdir(PROC) if entry.isdigit()]


def cmdline(pid: int) -> list[str]:
    """The process's argv ([] when it is gone, or a kernel thread)."""
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def start_ticks(pid: int) -> str | None:
    """When the process started, in clock ticks since boot (None when it is gone): with the
    pid, it names one process for good, where a pid alone may be reused."""
    fields = _stat_fields(pid)
    return None if fields is None else fields[19]


def parents() -> dict[int, int]:
    """pid -> parent pid, for every process there is."""
    out = {}
    for pid in pids():
        fields = _stat_fields(pid)
        if fields is not None:
            out[pid] = int(fields[1])
    return out


def children(pid: int | None = None) -> list[int]:
    """The running children of a process (this one by default)."""
    pid = os.getpid() if pid is None else pid
    return [child for child, parent in parents().items() if parent == pid and running(child)]


def rss_bytes(pid: int | str = "self") -> int:
    """Resident memory of one process (0 when it is gone)."""
    try:
        pages = int((PROC / str(pid) / "statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def tree_rss_bytes(root: int) -> int:
    """Resident memory of a process and all its descendants."""
    children: dict[int, list[int]] = {}
    for pid, parent in parents().items():
        children.setdefault(parent, []).append(pid)
    total, pending = 0, [root]
    while pending:
        pid = pending.pop()
        total += rss_bytes(pid)
        pending.extend(children.get(pid, []))
    return total


def peak_rss_bytes() -> int:
    """This process's peak resident memory since it started or since reset_peak_rss."""
    with contextlib.suppress(OSError):
        for line in (PROC / "self" / "status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return rss_bytes()


def reset_peak_rss() -> bool:
    """Start measuring this process's peak resident memory afresh (Linux: clear_refs 5);
    False where the kernel does not let it."""
    try:
        (PROC / "self" / "clear_refs").write_text("5")
    except OSError:
        return False
    return True


def blocks_signal(pid: int, signum: int) -> bool:
    """The process holds `signum` blocked (SigBlk in /proc/PID/status); False when gone."""
    try:
        status = (PROC / str(pid) / "status").read_text()
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("SigBlk:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False
