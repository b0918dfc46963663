"""The Ray side: the actors, the controller's view of them, where they are placed.

A Ray worker process imports this package before anything of its actor loads torch, so it
is where a trainer's processes bound oneDNN's caches of product shapes (torch reads one of
them as it loads; rlx/trainer/model/cpu_linear.py says why). A value already set is left as it is.
Nothing else of rlx touches them: `rlx lint` or a program of its own that imports rlx keeps
torch's defaults.

It is also where such a worker stops Python's cyclic collector until the actor has started
(rlx/trainer/collector.py says why)."""

import os
import sys

from rlx.trainer import collector

ONEDNN_CACHES = {"LRU_CACHE_CAPACITY": "64", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64"}


def bound_onednn_caches() -> None:
    for name, entries in ONEDNN_CACHES.items():
        os.environ.setdefault(name, entries)


bound_onednn_caches()


def _in_a_ray_worker() -> bool:
    worker = getattr(sys.modules.get("ray._private.worker"), "global_worker", None)
    ray = sys.modules.get("ray")
    return worker is not None and getattr(worker, "mode", None) == getattr(ray, "WORKER_MODE", ())


if _in_a_ray_worker():
    collector.defer()
