"""The head of a kept cluster: held while Ray jobs run or wait, ended once none has for
resources.idle_minutes (on a clock of the test's own), held for ever with `none`; and what
the kept recipe's head runs."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from typing import Any

import pytest

from rlx.launchers.keep import HOLD_COMMAND, kept_recipe, kept_until
from rlx.node import hold
from rlx.recipe.load import parse_recipe


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def held(idle_minutes: int, answers: Iterator[Any]) -> tuple[float, list[str]]:
    """Seconds held and the lines said, each poll answering the next of `answers` (a count of
    active jobs, or an exception to raise)."""
    clock, said = Clock(), []

    def count() -> int:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert hold.hold(idle_minutes, count, said.append, clock, clock.sleep, poll_seconds=30) == 0
    return clock.now, said


def test_ends_after_the_idle_limit_with_no_job():
    seconds, said = held(2, iter([0] * 100))
    assert seconds == 120
    assert "for 2 minutes (resources.idle_minutes)" in said[0]
    assert said[-1].startswith("rlx: no Ray job for 2 minutes")


def test_a_job_starts_the_idle_time_again():
    # busy for the first 5 polls (150 s), then idle: ends 2 minutes after the last busy poll
    seconds, _ = held(2, iter([1] * 5 + [0] * 100))
    assert seconds == 120 + 120


def test_a_dashboard_that_does_not_answer_counts_as_idle_and_is_said_once():
    seconds, said = held(1, iter([OSError("connection refused")] * 100))
    assert seconds == 60
    assert sum("does not list its jobs" in line for line in said) == 1


def test_none_holds_until_stopped():
    said: list[str] = []

    class Stopped(Exception):
        pass

    sleeps = iter(range(1000))

    def sleep(_: float) -> None:
        if next(sleeps) == 999:
            raise Stopped

    with pytest.raises(Stopped):
        hold.hold(None, lambda: 0, said.append, sleep=sleep)
    assert said == ["rlx: holding the cluster until `rlx down` (resources.idle_minutes: none)"]


def test_active_jobs_counts_what_has_not_ended(monkeypatch: pytest.MonkeyPatch):
    """Ray's Jobs API lists submitted jobs and drivers; only PENDING and RUNNING count. The
    job's token goes in the header Ray's dashboard checks."""
    jobs = [{"status": s} for s in ("RUNNING", "PENDING", "SUCCEEDED", "FAILED", "STOPPED")]
    seen: dict[str, Any] = {}

    def urlopen(request: Any, timeout: float) -> io.BytesIO:
        seen["url"], seen["auth"] = request.full_url, request.get_header("Authorization")
        return io.BytesIO(json.dumps(jobs).encode())

    monkeypatch.setattr(hold.urllib.request, "urlopen", urlopen)
    assert hold.active_jobs("http://127.0.0.1:8265", "t0ken") == 2
    assert seen == {"url": "http://127.0.0.1:8265/api/jobs/", "auth": "Bearer t0ken"}
    monkeypatch.setattr(hold.urllib.request, "urlopen", lambda *_, **__: io.BytesIO(b"{}"))
    with pytest.raises(ValueError):
        hold.active_jobs("http://127.0.0.1:8265", None)


def test_the_kept_head_holds_with_the_recipes_limit():
    recipe = parse_recipe("name: job\ncommand: [echo]\nresources:\n  idle_minutes: 20\n").recipe
    kept = kept_recipe(recipe)
    assert kept.head_command == [HOLD_COMMAND] and HOLD_COMMAND.endswith("exec rlx hold")
    assert kept.resources.idle_minutes == 20
    assert "for 20 minutes" in kept_until(kept)
    forever = parse_recipe("name: job\nresources:\n  idle_minutes: none\n").recipe
    assert kept_until(forever).startswith("until `rlx down`")


def test_rlx_hold_reads_the_recipe_and_the_token(monkeypatch: pytest.MonkeyPatch):
    from typer.testing import CliRunner

    from rlx.cli import app
    from rlx.node.env import RECIPE_ENV, recipe_json

    recipe = parse_recipe(
        "name: job\nresources:\n  idle_minutes: 7\nray:\n  dashboard_port: 8300\n"
    )
    got: dict[str, Any] = {}

    def fake_hold(minutes: int | None, count: Any, say: Any) -> int:
        got["minutes"], got["active"] = minutes, count()
        return 0

    def urlopen(request: Any, timeout: float) -> io.BytesIO:
        got["url"], got["auth"] = request.full_url, request.get_header("Authorization")
        return io.BytesIO(b"[]")

    monkeypatch.setattr(hold, "hold", fake_hold)
    monkeypatch.setattr(hold.urllib.request, "urlopen", urlopen)
    monkeypatch.setenv(RECIPE_ENV, recipe_json(recipe.recipe))
    monkeypatch.setenv("RAY_AUTH_TOKEN", "t0ken")
    result = CliRunner().invoke(app, ["hold"])
    assert result.exit_code == 0, result.output
    assert got == {
        "minutes": 7,
        "active": 0,
        "url": "http://127.0.0.1:8300/api/jobs/",
        "auth": "Bearer t0ken",
    }


def test_the_head_asks_the_dashboard_where_it_listens():
    assert hold.dashboard_host("127.0.0.1") == "127.0.0.1"
    assert hold.dashboard_host("0.0.0.0") == "127.0.0.1"
    assert hold.dashboard_host("10.0.0.5") == "10.0.0.5"
    assert hold.dashboard_host("fd00::5") == "[fd00::5]"
