"""A Ray worker that loads an actor defers Python's cyclic collector until the actor has
started (rlx/trainer/collector.py); any other process is left as it is."""

from __future__ import annotations

import gc

from rlx.trainer import collector


def test_a_process_that_is_no_ray_worker_keeps_its_collector() -> None:
    import rlx.trainer.actors  # noqa: F401  (defers only in a Ray worker)

    assert not collector._deferred
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    collector.settle(started=True)
    assert gc.isenabled() and gc.get_freeze_count() == frozen


def test_a_deferred_collector_freezes_at_each_stage_and_runs_once_started(monkeypatch) -> None:
    gc.disable()
    monkeypatch.setattr(collector, "_deferred", True)
    try:
        kept = [[] for _ in range(10)]  # what a start-up builds
        assert _collectable(kept)
        collector.settle(started=False)
        assert not gc.isenabled()  # the engine's imports are still to come
        # Frozen: in no generation the collector scans. (Asked of the object itself, not of
        # the freeze count, which another thread of the process may move meanwhile.)
        assert not _collectable(kept)
        collector.settle(started=True)
        assert gc.isenabled() and not collector._deferred
        later: list[object] = []
        collector.settle(started=True)  # once started, nothing more
        assert _collectable(later)
        assert kept
    finally:
        gc.unfreeze()
        gc.enable()


def _collectable(thing: object) -> bool:
    return any(obj is thing for obj in gc.get_objects())
