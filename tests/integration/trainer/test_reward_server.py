"""A reward server term against a real HTTP server on loopback (http.server in a thread):
errors are retried with backoff, a server past the timeout costs at most the bound, a
failure is NaN and counted (never 0), the concurrency cap holds, the auth header arrives,
and a server that is gone fails fast."""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from rlx.recipe.model import TrainerSettings
from rlx.trainer.tasks.reward_server import RewardServer
from rlx.trainer.tasks.reward_terms import build_terms

TIMEOUT_S = 0.5
SLEEP_S = 2.0  # the slow batch's server sleeps past the timeout
KEY = "loopback-key"


class _Server:
    """What the handler saw: requests per batch, the most in flight at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: dict[str, int] = {}
        self.in_flight = 0
        self.most_in_flight = 0
        self.headers: list[str | None] = []


def _handler(state: _Server) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:  # quiet
            pass

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            prompts = [s["prompt"] for s in body["samples"]]
            key = "|".join(prompts)
            with state.lock:
                state.calls[key] = state.calls.get(key, 0) + 1
                call = state.calls[key]
                state.in_flight += 1
                state.most_in_flight = max(state.most_in_flight, state.in_flight)
                state.headers.append(self.headers.get("Authorization"))
            try:
                status, payload = self._answer(body["samples"], prompts, call)
            finally:
                # out of flight before the answer is written: once the client has read it,
                # its next request may arrive before this thread would get past _send
                with state.lock:
                    state.in_flight -= 1
            self._send(status, payload)

        def _answer(
            self, samples: list[dict[str, Any]], prompts: list[str], call: int
        ) -> tuple[int, dict[str, Any]]:
            if self.headers.get("Authorization") != f"Bearer {KEY}":
                return 401, {"error": "no key"}
            if "fail" in prompts:
                return 500, {"error": "broken"}
            if "flaky" in prompts and call == 1:
                return 503, {"error": "busy"}
            if "slow" in prompts:
                time.sleep(SLEEP_S)
            if any(p.startswith("hold") for p in prompts):
                time.sleep(0.15)
            rewards = [
                None if s["prompt"] == "null" else float(len(s["response"])) for s in samples
            ]
            return 200, {"rewards": rewards}

        def _send(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (its timeout)

    return Handler


@pytest.fixture
def server() -> Iterator[tuple[str, _Server, ThreadingHTTPServer]]:
    state = _Server()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/score"
    try:
        yield url, state, httpd
    finally:
        httpd.shutdown()
        httpd.server_close()


def _terms(url: str, **fields: Any) -> Any:
    term = {
        "url": url,
        "name": "verifier",
        "timeout_s": TIMEOUT_S,
        "retries": 2,
        "backoff_s": 0.05,
        "batch_size": 1,
        "max_concurrency": 4,
        "auth_secret": "REWARD_KEY",
        **fields,
    }
    settings = TrainerSettings.model_validate(
        {"model": {"path": "tiny:qwen2-h64-l2"}, "data": {"train": "x.jsonl"}, "rewards": [term]}
    )
    return build_terms(settings, {"REWARD_KEY": KEY})


def test_failures_are_nan_counted_and_bounded_by_the_timeout(server):
    url, state, _httpd = server
    terms = _terms(url)
    prompts = ["ok", "ok2", "null", "fail", "flaky", "slow"]
    responses = ["a", "bbb", "cc", "dddd", "eeeee", "ff"]
    started = time.perf_counter()
    scored = terms.score(prompts, responses)
    took = time.perf_counter() - started
    values = scored.values[0].tolist()
    assert values[0] == 1.0 and values[1] == 3.0
    assert values[4] == 5.0  # a 503 tried again, after the backoff
    assert all(math.isnan(v) for v in (values[2], values[3], values[5]))  # never 0
    metrics = scored.metrics()
    assert metrics["reward/verifier/failed"] == 3.0
    assert metrics["reward/verifier/mean"] == 3.0  # (1 + 3 + 5) / 3: the finite values
    assert metrics["reward/failed"] == 0.5
    # a 500 is tried 1 + retries times; the flaky batch twice; the slow one timed out each try
    assert state.calls["fail"] == 3 and state.calls["flaky"] == 2 and state.calls["ok"] == 1
    assert state.calls["slow"] == 3
    # every batch in flight at once (4 <= max_concurrency): the slow one's tries and waits
    server_term = RewardServer(url, timeout_s=TIMEOUT_S, retries=2, backoff_s=0.05)
    bound = server_term.worst_case_s()  # 3 x 0.5 + 0.05 + 0.1
    assert bound == pytest.approx(1.65)
    assert took < bound + 1.0, took  # never the server's 3 x 2 s of sleep
    said = scored.failure_line()
    assert "verifier (url " in said and "failed on 3" in said
    assert "HTTP 500 Internal Server Error x3" in said
    assert "no answer within timeout_s 0.5 x3" in said
    assert said.endswith("and 1 more kinds")  # the 503 a retry cured comes last
    cured = RewardServer(url, backoff_s=0.05, headers={"Authorization": f"Bearer {KEY}"})
    outcome = cured.score(["flaky", "x"], ["ab", "c"], [None, None])
    assert outcome.values == [2.0, 1.0]
    assert (outcome.requests, outcome.failed_requests) == (2, 1)
    assert outcome.first_error == "HTTP 503 Service Unavailable (a retry answered)"
    assert set(state.headers) == {f"Bearer {KEY}"}  # the secret arrived, read from the env


def test_the_concurrency_cap_holds_and_a_wrong_key_is_not_retried(server):
    url, state, _httpd = server
    terms = _terms(url, max_concurrency=2)
    scored = terms.score([f"hold{i}" for i in range(6)], ["x"] * 6)
    assert scored.values[0].tolist() == [1.0] * 6
    assert state.most_in_flight == 2  # six 0.15 s batches: an unheld cap would overlap more
    # a 401 is the request's fault: one try, then NaN
    settings = TrainerSettings.model_validate(
        {
            "model": {"path": "tiny:qwen2-h64-l2"},
            "data": {"train": "x.jsonl"},
            "rewards": [{"url": url, "auth_secret": "REWARD_KEY", "retries": 3}],
        }
    )
    wrong = build_terms(settings, {"REWARD_KEY": "not-the-key"})
    scored = wrong.score(["ok"], ["x"])
    assert math.isnan(scored.values[0, 0].item())
    assert state.calls["ok"] == 1
    assert "HTTP 401" in scored.failure_line()
    assert "not-the-key" not in scored.failure_line()


def test_a_server_that_is_gone_fails_fast(server):
    url, _state, httpd = server
    terms = _terms(url, retries=1)
    assert terms.score(["ok"], ["ab"]).values[0].tolist() == [2.0]
    httpd.shutdown()
    httpd.server_close()  # killed mid-run
    started = time.perf_counter()
    scored = terms.score(["ok", "ok2"], ["ab", "c"])
    assert time.perf_counter() - started < 2.0
    assert all(math.isnan(v) for v in scored.values[0].tolist())
    assert scored.metrics()["reward/verifier/failed"] == 2.0
