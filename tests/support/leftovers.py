"""Every test module ends what it started: a module whose processes outlive it fails.

While a module runs, the test process carries RLX_TEST_OWNER=<worker>:<module>:<nonce> in its
environment; every process started from it inherits the variable (Ray's daemons and workers,
engines and their subprocesses, servers, `rlx` commands, the trainer), whoever its parent is
by then. When the module's fixtures are torn down, the processes that still carry the value
get LEFTOVER_GRACE seconds to exit; those still running are killed (so they cannot disturb
the modules after) and the module fails, naming them.

Session fixtures whose processes live on purpose across modules (the Slurm cluster, the
dstack server) start them inside `shared()`, which takes the variable away meanwhile.
Processes started with an environment of their own (the emulated hosts' clean homes) are not
followed: their tests check the hosts themselves (tests/support/hosts).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import Iterator

import pytest

from rlx import procfs

OWNER = "RLX_TEST_OWNER"
# How long a module's processes may take to exit once its fixtures are torn down: what a run
# owes its processes (docs/processes.md) plus a margin for a loaded machine.
LEFTOVER_GRACE = 30.0


def _owned_by(value: str) -> list[int]:
    needle = f"{OWNER}={value}".encode()
    me = os.getpid()
    found = []
    for pid in procfs.pids():
        if pid == me:
            continue
        try:
            environ = (procfs.PROC / str(pid) / "environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0") and procfs.running(pid):
            found.append(pid)
    return found


def _describe(pid: int) -> str:
    argv = procfs.cmdline(pid)
    return f"{pid} {' '.join(argv)[:100] or '?'}"


@contextlib.contextmanager
def shared() -> Iterator[None]:
    """Start what lives across modules (session fixtures) without the module's mark."""
    value = os.environ.pop(OWNER, None)
    try:
        yield
    finally:
        if value is not None:
            os.environ[OWNER] = value


@pytest.fixture(scope="module", autouse=True)
def _module_ends_what_it_started(request: pytest.FixtureRequest) -> Iterator[None]:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    value = f"{worker}:{request.module.__name__}:{uuid.uuid4().hex[:8]}"
    os.environ[OWNER] = value
    try:
        yield
    finally:
        os.environ.pop(OWNER, None)
    deadline = time.monotonic() + LEFTOVER_GRACE
    left = _owned_by(value)
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = _owned_by(value)
    if not left:
        return
    named = [_describe(pid) for pid in left]
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    shown = "; ".join(named[:8]) + (f"; and {len(named) - 8} more" if len(named) > 8 else "")
    pytest.fail(
        f"{request.module.__name__}: {len(named)} process(es) it started still ran "
        f"{LEFTOVER_GRACE:.0f} s after its end (killed now): {shown}",
        pytrace=False,
    )
