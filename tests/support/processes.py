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


# What every rank of a test's process group imports: loaded once, in multiprocessing's
# fork server, whose forks then start with it instead of importing it again each (torch,
# its distributed checkpointing, transformers and rlx's training worker: about 8 s of CPU a
# process here).
RANK_PRELOAD = ("rlx.trainer.actors.workers", "transformers")


def fork_ranks(fn: Callable[..., None], args: tuple[object, ...], nprocs: int) -> None:
    """fn(rank, *args) in `nprocs` fresh processes, as torch.multiprocessing.spawn runs it
    (an error in a rank raises here), but forked from the fork server, which has
    RANK_PRELOAD imported."""
    import multiprocessing.forkserver as forkserver

    import torch.multiprocessing as mp

    forkserver.set_forkserver_preload(list(RANK_PRELOAD))  # read when the server first starts
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")


def spawn_ranks(fn: Callable[..., None], world: int, *args: object) -> None:
    """fn(rank, world, port, *args) in `world` processes (fork_ranks). A port found free can
    be taken by another test's process before rank 0 listens on it (EADDRINUSE at start-up,
    nothing written yet): then again on a fresh port, twice at most."""
    import socket

    import torch.multiprocessing as mp

    for attempt in range(3):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        try:
            fork_ranks(fn, (world, port, *args), world)
            return
        except mp.ProcessRaisedException as exc:
            if "EADDRINUSE" not in str(exc) or attempt == 2:
                raise
