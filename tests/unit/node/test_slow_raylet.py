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
