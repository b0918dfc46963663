"""A raylet that registers later than `ray start` allows (a fixed 30 s in Ray) is waited for
until the recipe's join timeout, on the head and on a worker, instead of failing the job."""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path

import pytest

from rlx.errors import RlxError
from rlx.node import bootstrap, raynode
from rlx.node.env import NodeInfo
from rlx.recipe import parse_recipe

HEAD, WORKER = "10.0.0.1", "10.0.0.2"
SLOW = RlxError(
    "`ray start --address=10.0.0.1:6379` failed (exit 1):\n  Exception: The current node "
    f"{raynode.RAYLET_SLOW}. This could happen because some of the raylet failed to startup "
    "or the GCS has become overloaded."
)


def test_ray_still_says_what_we_look_for():
    """The text is Ray's (ray/_private/node.py): if a Ray upgrade rewords it, this fails."""
    spec = importlib.util.find_spec("ray")
    assert spec is not None and spec.origin is not None
    source = (Path(spec.origin).parent / "_private" / "node.py").read_text()
    assert raynode.RAYLET_SLOW in source


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Gcs:
    """Lists the worker as alive from the `joins_at`-th call of nodes() on."""

    def __init__(self, joins_at: int | None) -> None:
        self.calls = 0
        self.joins_at = joins_at

    def nodes(self) -> list[raynode.NodeState]:
        self.calls += 1
        joined = self.joins_at is not None and self.calls >= self.joins_at
        return [raynode.NodeState(HEAD, True, 0.0)] + (
            [raynode.NodeState(WORKER, True, 0.0)] if joined else []
        )


@pytest.fixture
def worker(monkeypatch):
    for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv(raynode.GCS_CONNECT_TIMEOUT_ENV, "30")
    monkeypatch.setattr(bootstrap.time, "sleep", lambda _s: None)
    recipe = parse_recipe(
        'name: probe\ncommand: ["true"]\nray: {auth: none, join_timeout: 60}\n', "p.yaml"
    ).recipe
    node = NodeInfo("sky", 1, (HEAD, WORKER), (HEAD, WORKER), 0, None)
    clock = Clock()
    boot = bootstrap.Bootstrap(recipe, node, {}, out=io.StringIO(), clock=clock)
    return boot, clock


def starts(monkeypatch, outcomes: list[Exception | None]) -> list[int]:
    """run_ray_start gives each outcome in turn; the list of calls made."""
    calls: list[int] = []

    def run_ray_start(_argv, _env, _timeout, _hold_sigterm):
        calls.append(1)
        outcome = outcomes[len(calls) - 1]
        if outcome is not None:
            raise outcome

    monkeypatch.setattr(raynode, "run_ray_start", run_ray_start)
    return calls


def test_a_worker_waits_for_its_slow_raylet(worker, monkeypatch):
    boot, _clock = worker
    calls = starts(monkeypatch, [SLOW])
    monkeypatch.setattr(raynode, "raylet_alive", lambda _a, _p: True)
    gcs = Gcs(joins_at=3)
    boot.start_worker_ray(gcs)  # type: ignore[arg-type]
    assert len(calls) == 1 and gcs.calls == 3
    assert "waiting for it until the join timeout (60 s)" in boot.out.getvalue()


def test_a_worker_whose_raylet_died_starts_ray_once_more(worker, monkeypatch):
    boot, _clock = worker
    calls = starts(monkeypatch, [SLOW, None])
    stopped: list[str] = []
    monkeypatch.setattr(raynode, "raylet_alive", lambda _a, _p: False)
    monkeypatch.setattr(raynode, "stop_own_ray", lambda address, _p: stopped.append(address))
    boot.start_worker_ray(Gcs(joins_at=None))  # type: ignore[arg-type]
    assert len(calls) == 2 and stopped == [f"{HEAD}:6379"]
    assert "starting Ray again" in boot.out.getvalue()


def test_a_worker_gives_up_at_the_join_timeout(worker, monkeypatch):
    boot, clock = worker
    starts(monkeypatch, [SLOW])

    def alive(_a, _p):
        clock.now += 10  # every poll takes 10 s of the 60 s join timeout
        return True

    monkeypatch.setattr(raynode, "raylet_alive", alive)
    with pytest.raises(RlxError, match="timed out during startup"):
        boot.start_worker_ray(Gcs(joins_at=None))  # type: ignore[arg-type]
    assert clock.now >= 60


def test_other_ray_start_failures_are_not_retried(worker, monkeypatch):
    boot, _clock = worker
    calls = starts(monkeypatch, [RlxError("`ray start` failed (exit 1): port in use")])
    with pytest.raises(RlxError, match="port in use"):
        boot.start_worker_ray(Gcs(joins_at=1))  # type: ignore[arg-type]
    assert len(calls) == 1


class Start:
    def __init__(self, error: RlxError) -> None:
        self.error = error

    def check(self) -> bool:
        raise self.error


def test_the_head_counts_a_slow_raylet_as_started_while_it_runs(worker, monkeypatch):
    boot, _clock = worker
    monkeypatch.setattr(raynode, "raylet_alive", lambda _a, _p: True)
    assert boot.head_started(Start(SLOW)) is True  # type: ignore[arg-type]
    assert boot.head_started(Start(SLOW)) is True  # type: ignore[arg-type]
    assert boot.out.getvalue().count("gave up on the head's raylet") == 1


def test_the_head_fails_if_its_slow_raylet_is_gone(worker, monkeypatch):
    boot, _clock = worker
    monkeypatch.setattr(raynode, "raylet_alive", lambda _a, _p: False)
    with pytest.raises(RlxError, match="timed out during startup"):
        boot.head_started(Start(SLOW))  # type: ignore[arg-type]
    with pytest.raises(RlxError, match="port in use"):
        boot.head_started(Start(RlxError("port in use")))  # type: ignore[arg-type]


def test_ray_still_says_the_head_node_is_missing():
    """The text is Ray's (ray/_private/utils.py): if a Ray upgrade rewords it, this fails."""
    spec = importlib.util.find_spec("ray")
    assert spec is not None and spec.origin is not None
    source = (Path(spec.origin).parent / "_private" / "utils.py").read_text()
    assert raynode.HEAD_NODE_MISSING in source


def test_a_worker_whose_raylet_dies_every_time_tries_three_times_in_all(worker, monkeypatch):
    boot, _clock = worker
    calls = starts(monkeypatch, [SLOW, SLOW, SLOW])
    monkeypatch.setattr(raynode, "raylet_alive", lambda _a, _p: False)
    monkeypatch.setattr(raynode, "stop_own_ray", lambda _a, _p: 0)
    with pytest.raises(RlxError, match="timed out during startup"):
        boot.start_worker_ray(Gcs(joins_at=None))  # type: ignore[arg-type]
    assert len(calls) == bootstrap.RAY_START_TRIES == 3
    assert "(try 3 of 3)" in boot.out.getvalue()


def test_a_worker_that_finds_no_head_node_goes_back_to_waiting(worker, monkeypatch):
    boot, _clock = worker
    missing = RlxError(f"`ray start` failed (exit 1):\n  Exception: {raynode.HEAD_NODE_MISSING}")
    calls = starts(monkeypatch, [missing])
    assert boot.start_worker_ray(Gcs(joins_at=None)) is False  # type: ignore[arg-type]
    assert len(calls) == 1


class HeadGcs:
    """A head whose own node registers at the `head_at`-th call of nodes(); its attempt key
    changes to b"new" at the `restart_at`-th."""

    def __init__(self, head_at: int | None, restart_at: int | None = None) -> None:
        self.calls = 0
        self.head_at, self.restart_at = head_at, restart_at

    def nodes(self) -> list[raynode.NodeState]:
        self.calls += 1
        listed = self.head_at is not None and self.calls >= self.head_at
        return [raynode.NodeState(HEAD, True, 0.0)] if listed else []

    def get(self, _key: bytes) -> bytes:
        restarted = self.restart_at is not None and self.calls >= self.restart_at
        return b"new" if restarted else b"old"


def test_a_worker_joins_only_once_the_head_node_is_listed(worker):
    boot, _clock = worker
    gcs = HeadGcs(head_at=4)
    assert boot.wait_for_head_node(gcs, b"old") is True  # type: ignore[arg-type]
    assert gcs.calls == 4
    assert boot.wait_for_head_node(HeadGcs(None, restart_at=2), b"old") is False  # type: ignore[arg-type]


def test_a_head_node_that_never_registers_is_named_at_the_join_timeout(worker):
    boot, clock = worker

    class Late(HeadGcs):
        def nodes(self) -> list[raynode.NodeState]:
            clock.now += 10
            return super().nodes()

    with pytest.raises(bootstrap.ClusterError, match="did not register its own node within 60 s"):
        boot.wait_for_head_node(Late(None), b"old")  # type: ignore[arg-type]


def test_the_head_starts_ray_again_when_its_raylet_died(worker, monkeypatch):
    boot, _clock = worker
    tries: list[int] = []

    def start_head_ray():
        tries.append(1)
        if len(tries) < 3:
            raise SLOW
        raise bootstrap.ClusterError("stop here")  # the third try got as far as the nodes

    monkeypatch.setattr(boot, "start_head_ray", start_head_ray)
    monkeypatch.setattr(raynode, "stop_own_ray", lambda _a, _p: 0)
    monkeypatch.setattr(raynode, "preload", lambda: None)
    with pytest.raises(bootstrap.ClusterError, match="stop here"):
        boot.run_head()
    assert len(tries) == 3
    out = boot.out.getvalue()
    assert "starting Ray on the head again (try 2 of 3)" in out and "(try 3 of 3)" in out


def test_the_head_gives_up_after_its_last_try(worker, monkeypatch):
    boot, _clock = worker
    tries: list[int] = []

    def start_head_ray():
        tries.append(1)
        raise SLOW

    monkeypatch.setattr(boot, "start_head_ray", start_head_ray)
    monkeypatch.setattr(raynode, "stop_own_ray", lambda _a, _p: 0)
    monkeypatch.setattr(raynode, "preload", lambda: None)
    with pytest.raises(RlxError, match="timed out during startup"):
        boot.run_head()
    assert len(tries) == bootstrap.RAY_START_TRIES
