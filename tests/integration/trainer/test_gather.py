"""A worker that dies while the others wait for it (in a collective, as FSDP ranks do) fails
the call at once, with one line, instead of hanging until the process group's timeout."""

from __future__ import annotations

import os
import signal
import time

import pytest

from rlx.errors import RlxError
from rlx.trainer.actors.cluster import gather


class Rank:
    def pid(self) -> int:
        return os.getpid()

    def wait_for_peer(self, seconds: float) -> str:
        time.sleep(seconds)  # a collective whose peer never comes
        return "done"

    def die(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def collector(self, settle: bool) -> tuple[bool, bool, int]:
        """(deferred, enabled, objects frozen) of this worker's collector, after settling."""
        import gc

        from rlx.trainer import collector

        if settle:
            collector.settle(started=True)
        return collector._deferred, gc.isenabled(), gc.get_freeze_count()


def test_the_first_failure_is_raised_without_waiting_for_the_rest(local_ray) -> None:
    ray = local_ray
    actor = ray.remote(num_cpus=0)(Rank)
    waiting, dying = actor.remote(), actor.remote()
    ray.get([waiting.pid.remote(), dying.pid.remote()])
    started = time.monotonic()
    with pytest.raises(RlxError, match="a training worker died") as info:
        gather([waiting.wait_for_peer.remote(600), dying.die.remote()], "training worker")
    assert time.monotonic() - started < 60
    assert "\n" not in str(info.value)
    ray.kill(waiting)


def test_a_ray_worker_loading_an_actor_defers_the_collector_until_it_started(local_ray) -> None:
    """This module imports rlx.trainer.actors, as the actors' own modules do: the worker that
    loads Rank stops automatic collections until the actor settles (rlx/trainer/collector.py)."""
    actor = local_ray.remote(num_cpus=0)(Rank).remote()
    assert local_ray.get(actor.collector.remote(False))[:2] == (True, False)
    deferred, enabled, frozen = local_ray.get(actor.collector.remote(True))
    assert (deferred, enabled) == (False, True) and frozen > 100_000  # torch's objects
    local_ray.kill(actor)
