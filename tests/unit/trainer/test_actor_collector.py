"""A Ray worker that loads an actor defers Python's cyclic collector until the actor has
started (rlx/trainer/actors/__init__.py); any other process is left as it is."""

from __future__ import annotations

import gc

import rlx.trainer.actors as actors


def test_a_process_that_is_no_ray_worker_keeps_its_collector() -> None:
    assert not actors._collection_deferred
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    actors.settle(started=True)
    assert gc.isenabled() and gc.get_freeze_count() == frozen


def test_a_deferred_collector_freezes_at_each_stage_and_runs_once_started(monkeypatch) -> None:
    gc.disable()
    monkeypatch.setattr(actors, "_collection_deferred", True)
    try:
        before = gc.get_freeze_count()
        kept = [[] for _ in range(10)]  # what a start-up builds
        actors.settle(started=False)
        assert not gc.isenabled()  # the engine's imports are still to come
        assert gc.get_freeze_count() > before
        actors.settle(started=True)
        assert gc.isenabled() and not actors._collection_deferred
        again = gc.get_freeze_count()
        actors.settle(started=True)  # once started, nothing more
        assert gc.get_freeze_count() == again
        assert kept
    finally:
        gc.unfreeze()
        gc.enable()
