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
