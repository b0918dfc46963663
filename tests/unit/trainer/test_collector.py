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
        before = gc.get_freeze_count()
        kept = [[] for _ in range(10)]  # what a start-up builds
        collector.settle(started=False)
        assert not gc.isenabled()  # the engine's imports are still to come
        assert gc.get_freeze_count() > before
        collector.settle(started=True)
        assert gc.isenabled() and not collector._deferred
        again = gc.get_freeze_count()
        collector.settle(started=True)  # once started, nothing more
        assert gc.get_freeze_count() == again
        assert kept
    finally:
        gc.unfreeze()
        gc.enable()
