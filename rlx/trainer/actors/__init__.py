"""The Ray side: the actors, the controller's view of them, where they are placed.

A Ray worker process imports this package before anything of its actor loads torch, so it
is where a trainer's processes bound oneDNN's caches of product shapes (torch reads one of
them as it loads; rlx/trainer/model/cpu_linear.py says why). A value already set is left as it is.
Nothing else of rlx touches them: `rlx lint` or a program of its own that imports rlx keeps
torch's defaults.

It is also where a Ray worker that loads one of the actors stops Python's cyclic garbage
collector until the actor has started (`settle`): its imports (torch, transformers, vLLM where
the actor holds an engine) build about 700,000 objects, and the collector would scan all of
them again each time they grew by a quarter, about 2 CPU-s of a 12 CPU-s start-up. What the
start-up built is frozen (kept out of every later collection, as it lives as long as the
process): once as the actor starts, so the collections vLLM asks for as it loads skip torch's
objects, and again when its model and engine are built, so every later one scans only what
was made since. Other processes that import this package are left as they are."""

import gc
import os
import sys

ONEDNN_CACHES = {"LRU_CACHE_CAPACITY": "64", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64"}


def bound_onednn_caches() -> None:
    for name, entries in ONEDNN_CACHES.items():
        os.environ.setdefault(name, entries)


bound_onednn_caches()


def _in_a_ray_worker() -> bool:
    worker = getattr(sys.modules.get("ray._private.worker"), "global_worker", None)
    ray = sys.modules.get("ray")
    return worker is not None and getattr(worker, "mode", None) == getattr(ray, "WORKER_MODE", ())


_collection_deferred = _in_a_ray_worker() and gc.isenabled()
if _collection_deferred:
    gc.disable()


def settle(started: bool) -> None:
    """Freeze what an actor's process has imported and built so far; `started`: its start-up
    is over (model and engine built), and the collector runs as usual again. Outside a Ray
    worker, or once started, nothing."""
    global _collection_deferred
    if _collection_deferred:
        gc.freeze()
        if started:
            gc.enable()
            _collection_deferred = False
