"""A run owns the processes it starts: they end when it ends, however it ends.

Ray's daemons start with SIGTERM blocked (rlx.sigterm), so that a spot reclaim cannot take
them before the step is saved; the other side of that choice is that nothing but SIGKILL
stops them, and a run killed outright (`kill -9`, the OOM killer, a closed terminal) would
leave them running, re-parented to init, holding memory, ports and GPUs. So a run marks
every process it starts: its token goes into the environment, which every child inherits
whatever it does with its process group or session (Ray's daemons and workers, engines and
their subprocesses, servers). A watchdog, started first, in a session of its own, with
SIGTERM, SIGINT and SIGHUP ignored, waits on a pipe from the run; the pipe closes when the
run's process ends, by its own exit or by SIGKILL, and the watchdog then ends every process
that carries the token (a moment's grace, then SIGKILL) and exits. The next run on the
machine also ends what a dead run's watchdog could not (a watchdog killed too, a machine
that froze), before it starts its own.

Runs nest (`rlx node` runs `rlx train`): the variable holds every owner's token, and each
watchdog ends what carries its own.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import TextIO

from rlx import procfs

OWNER_ENV = "RLX_RUN_OWNER"
GRACE_S = 2.0  # for a process to end by itself once its run has
END_BOUND_S = 15.0  # the bound on everything a run started being gone after it ended


def _tokens(environ: bytes) -> list[str]:
    prefix = OWNER_ENV.encode() + b"="
    for entry in environ.split(b"\0"):
        if entry.startswith(prefix):
            return entry[len(prefix) :].decode(errors="replace").split()
    return []


def _environ(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            return handle.read()
    except OSError:
        return b""


def carrying(token: str, exclude: frozenset[int] = frozenset()) -> list[int]:
    """The running processes whose environment carries `token`."""
    me = os.getpid()
    return [
        pid
        for pid in procfs.pids()
        if pid != me
        and pid not in exclude
        and token in _tokens(_environ(pid))
        and procfs.running(pid)
    ]


def end_carriers(token: str, grace: float = GRACE_S) -> list[int]:
    """Every process carrying `token` ended: `grace` to go by itself, then SIGKILL, again
    until none is left (a dying Ray may start a worker meanwhile), END_BOUND_S at most.
    Returns the pids that had to be killed."""
    deadline = time.monotonic() + grace
    while carrying(token) and time.monotonic() < deadline:
        time.sleep(0.1)
    killed: list[int] = []
    stop = time.monotonic() + END_BOUND_S
    while time.monotonic() < stop:
        left = carrying(token)
        if not left:
            break
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        time.sleep(0.1)
    return killed


def _owner_alive(token: str) -> bool:
    """A token is `pid-start-random`: its owner still runs if that pid has that start."""
    pid, _, rest = token.partition("-")
    start = rest.partition("-")[0]
    return pid.isdigit() and procfs.start_ticks(int(pid)) == start


def _pid_namespace(pid: int | str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def orphans() -> dict[str, list[int]]:
    """token -> the processes still carrying it, for tokens whose owner is gone. Only this
    PID namespace's: a token names its owner by a pid of the owner's own namespace (a
    container's, an emulated host's), which means another process, or none, here."""
    found: dict[str, list[int]] = {}
    me = os.getpid()
    mine = _pid_namespace("self")
    for pid in procfs.pids():
        if pid == me or mine is None or _pid_namespace(pid) != mine:
            continue
        for token in _tokens(_environ(pid)):
            if not _owner_alive(token) and procfs.running(pid):
                found.setdefault(token, []).append(pid)
    return found


def clear_orphans(out: TextIO | None = None) -> int:
    """End what dead runs left on this machine; one line when there was anything."""
    left = orphans()
    if not left:
        return 0
    ended = sorted(pid for pids in left.values() for pid in pids)
    for token in left:
        end_carriers(token, grace=0.0)
    print(
        f"ended {len(ended)} process(es) that {len(left)} earlier run(s) left running here "
        f"(killed before they could end them): pids {', '.join(map(str, ended))}",
        file=out or sys.stderr,
    )
    count = len(ended)
    return count


def new_token() -> str:
    return f"{os.getpid()}-{procfs.start_ticks(os.getpid())}-{secrets.token_hex(4)}"


@contextlib.contextmanager
def owned_run() -> Iterator[str]:
    """The processes started inside (by this process or its children, at any depth) end
    when the block ends or this process dies. Yields the run's token."""
    clear_orphans()
    token = new_token()
    outer = os.environ.get(OWNER_ENV, "").split()
    clean_env = {k: v for k, v in os.environ.items() if k != OWNER_ENV}
    watchdog = subprocess.Popen(
        [sys.executable, "-m", "rlx.owner", token],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=clean_env,
        start_new_session=True,  # the terminal's Ctrl-C and the job's group signals miss it
        close_fds=True,
    )
    os.environ[OWNER_ENV] = " ".join([*outer, token])
    try:
        yield token
    finally:
        if outer:
            os.environ[OWNER_ENV] = " ".join(outer)
        else:
            os.environ.pop(OWNER_ENV, None)
        assert watchdog.stdin is not None
        watchdog.stdin.close()  # the watchdog ends what is left, then exits
        with contextlib.suppress(subprocess.TimeoutExpired):
            watchdog.wait(timeout=GRACE_S + END_BOUND_S)


def _watch(token: str) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    while sys.stdin.buffer.read(65536):  # EOF: the run's process closed it or died
        pass
    end_carriers(token)


if __name__ == "__main__":
    _watch(sys.argv[1])
