"""What a test's in-process engine started must end when the engine is closed: the children
of this process that appeared while it was built, gone within a bound after close()."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import psutil

# rlx's bound for a process to end with what started it (engines, servers, Ray's daemons)
END_BOUND_S = 15.0


# multiprocessing's resource tracker: this process's own bookkeeping, started on the first
# semaphore or shared memory it makes, ending when this process does (EOF on its pipe)
OWN_HELPERS = ("multiprocessing.resource_tracker",)


def _children() -> dict[int, psutil.Process]:
    out = {}
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if not any(helper in " ".join(proc.cmdline()) for helper in OWN_HELPERS):
                out[proc.pid] = proc
    return out


@contextlib.contextmanager
def started_processes() -> Iterator[dict[int, psutil.Process]]:
    """The processes this one started inside the block (filled when it ends)."""
    before = set(_children())
    started: dict[int, psutil.Process] = {}
    yield started
    started.update({pid: p for pid, p in _children().items() if pid not in before})


def close_and_check_gone(close: Callable[[], None], started: dict[int, psutil.Process]) -> None:
    """close(), then every process in `started` must end within END_BOUND_S: an
    AssertionError names those still alive."""
    close()
    _, alive = psutil.wait_procs(list(started.values()), timeout=END_BOUND_S)
    names = []
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            names.append(f"{proc.pid} {' '.join(proc.cmdline())[:120]}")
            proc.kill()
    assert not names, f"still running {END_BOUND_S:.0f} s after close(): {', '.join(names)}"
