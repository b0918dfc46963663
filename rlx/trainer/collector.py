"""Python's cyclic garbage collector while a Ray worker process starts an actor.

The imports of a training or rollout actor (torch, transformers, vLLM where it holds an engine)
build about a million objects, and the collector would scan all of them again each time they
grew by a quarter: about 2 CPU-s of a 12 CPU-s start-up, and vLLM asks for full collections of
its own as it loads (about 1 CPU-s each over that heap). So in a Ray worker the collector waits
(`defer`, from rlx/trainer/actors/__init__.py, which such a worker imports first), and what the
start-up has built is frozen as it goes (`settle`): kept out of every later collection, as it
lives as long as the process. Other processes are left as they are.
"""

from __future__ import annotations

import gc

_deferred = False


def defer() -> None:
    """Stop automatic collections until `settle(started=True)` (if they run now)."""
    global _deferred
    if gc.isenabled():
        gc.disable()
        _deferred = True


def settle(started: bool) -> None:
    """Freeze what this process has imported and built so far; `started`: its start-up is
    over (model and engine built) and automatic collections run again. Nothing unless
    `defer` stopped them."""
    global _deferred
    if _deferred:
        gc.freeze()
        if started:
            gc.enable()
            _deferred = False
