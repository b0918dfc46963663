"""An HTTP reward server as a reward term (trainer.rewards[].url).

rlx POSTs the samples in batches of at most batch_size, JSON:

    {"samples": [{"prompt": str, "response": str, "answer": str | null}, ...]}

and reads, with status 200,

    {"rewards": [number | null, ...]}

one entry per sample, in order. null (or anything that is not a finite number) marks a
sample the server could not score: it gets NaN, never 0. A request that fails (a connection
error, a timeout, a status other than 200, a body that is not the above) is tried again
after backoff_s, 2 x backoff_s, ... up to `retries` more times; a 4xx other than 408 and 429
is not tried again (the request itself is wrong). After the last try every sample of the
batch gets NaN. At most max_concurrency requests are in flight at once, so one call scores
its samples within ceil(batches / max_concurrency) x worst_case_s() seconds.

The auth header's value comes from the environment variable auth_secret names, read when
the scorer is made; it is sent and never logged or written anywhere.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from rlx.errors import RlxError

_CURED = " (a retry answered)"
# Statuses a retry may cure: the server is busy, restarting or overloaded.
RETRIED_CLIENT_STATUSES = (408, 429)


@dataclass
class ServerOutcome:
    """One call's scores (NaN where failed) and what went wrong, for the metrics and the
    stop line."""

    values: list[float]
    requests: int = 0  # HTTP requests made, retries included
    failed_requests: int = 0  # requests that failed (each retry counts)
    first_error: str | None = None  # the failures, in words (never a header)
    errors: list[str] = field(default_factory=list)


class RewardServer:
    """Scores (prompt, response, answer) samples with an HTTP reward server."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 30.0,
        retries: int = 2,
        backoff_s: float = 1.0,
        max_concurrency: int = 4,
        batch_size: int = 32,
        headers: dict[str, str] | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_concurrency = max_concurrency
        self.batch_size = batch_size
        self._headers = {"Content-Type": "application/json", **(headers or {})}
        self._sleep = sleep

    @classmethod
    def of_term(cls, term: Any, env: dict[str, str] | None = None) -> RewardServer:
        """The server a trainer.rewards term names, its auth header's value read from the
        environment now (RlxError, one line, when the secret is not set)."""
        env = dict(os.environ) if env is None else env
        headers = {}
        if term.auth_secret is not None:
            value = env.get(term.auth_secret)
            if not value:
                raise RlxError(
                    f"trainer.rewards: term {term.label!r} sends secret {term.auth_secret}, "
                    "which is not set in the environment; export it where you launch (it "
                    "is listed in secrets:, so rlx passes it to the nodes)"
                )
            scheme = term.auth_scheme.strip()
            headers[term.auth_header] = f"{scheme} {value}" if scheme else value
        return cls(
            term.url,
            timeout_s=term.timeout_s,
            retries=term.retries,
            backoff_s=term.backoff_s,
            max_concurrency=term.max_concurrency,
            batch_size=term.batch_size,
            headers=headers,
        )

    def worst_case_s(self) -> float:
        """The longest one request's tries and waits may take."""
        waits = sum(self.backoff_s * 2**i for i in range(self.retries))
        return (self.retries + 1) * self.timeout_s + waits

    def score(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        answers: Sequence[str | None],
    ) -> ServerOutcome:
        """Every sample's reward, NaN where the server gave none."""
        samples = [
            {"prompt": p, "response": r, "answer": a}
            for p, r, a in zip(prompts, responses, answers, strict=True)
        ]
        size = self.batch_size
        batches = [samples[i : i + size] for i in range(0, len(samples), size)]
        outcome = ServerOutcome(values=[])
        if not batches:
            return outcome
        workers = min(self.max_concurrency, len(batches))
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="reward-url")
        try:
            results = list(pool.map(self._batch, batches))
        finally:  # a call stopped from outside (the stall window) sends nothing more
            pool.shutdown(wait=False, cancel_futures=True)
        for values, requests, failed, errors in results:
            outcome.values.extend(values)
            outcome.requests += requests
            outcome.failed_requests += failed
            outcome.errors.extend(errors)
        outcome.first_error = _summary(outcome.errors)
        return outcome

    def _batch(self, samples: list[dict[str, Any]]) -> tuple[list[float], int, int, list[str]]:
        """(values, requests made, requests failed, what went wrong in words) of one batch."""
        body = json.dumps({"samples": samples}).encode()
        failures: list[str] = []
        for attempt in range(self.retries + 1):
            if attempt:
                self._sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                values, nulls = self._post(body, len(samples))
            except _Failed as failed:
                failures.append(str(failed))
                if not failed.retry:
                    break
                continue
            notes = [f"{failure}{_CURED}" for failure in failures]
            if nulls:
                notes.append(f"{nulls} of {len(samples)} rewards null or not finite")
            return values, attempt + 1, len(failures), notes
        return [math.nan] * len(samples), len(failures), len(failures), failures

    def _post(self, body: bytes, count: int) -> tuple[list[float], int]:
        request = urllib.request.Request(self.url, data=body, headers=self._headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                raw = reply.read()
        except urllib.error.HTTPError as exc:
            retry = exc.code >= 500 or exc.code in RETRIED_CLIENT_STATUSES
            raise _Failed(f"HTTP {exc.code} {exc.reason}", retry) from None
        except (TimeoutError, urllib.error.URLError, http.client.HTTPException, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, TimeoutError) or "timed out" in str(reason):
                raise _Failed(f"no answer within timeout_s {self.timeout_s:g}", True) from None
            raise _Failed(f"{type(reason).__name__}: {reason}", True) from None
        try:
            rewards = json.loads(raw)["rewards"]
            if not isinstance(rewards, list) or len(rewards) != count:
                raise ValueError
        except (ValueError, KeyError, TypeError):
            raise _Failed(
                f'the answer is not {{"rewards": [...]}} with {count} entries', True
            ) from None
        values = [_finite(v) for v in rewards]
        return values, sum(math.isnan(v) for v in values)


def _summary(errors: list[str], most: int = 3) -> str | None:
    """The distinct failures, the most frequent first, each with its count."""
    if not errors:
        return None
    counts: dict[str, int] = {}
    for error in errors:
        counts[error] = counts.get(error, 0) + 1
    # what cost samples first, then what a retry cured
    ranked = sorted(counts.items(), key=lambda item: (item[0].endswith(_CURED), -item[1]))
    said = [f"{error} x{count}" if count > 1 else error for error, count in ranked[:most]]
    more = f" and {len(ranked) - most} more kinds" if len(ranked) > most else ""
    return ", ".join(said) + more


class _Failed(Exception):
    def __init__(self, message: str, retry: bool) -> None:
        super().__init__(message)
        self.retry = retry


def _finite(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return math.nan
    number = float(value)
    return number if math.isfinite(number) else math.nan
