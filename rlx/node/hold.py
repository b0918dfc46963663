"""What the head of a kept cluster (`rlx launch --keep`) runs instead of a trainer: it holds
the cluster while Ray jobs run or wait on it, and ends once none has for
resources.idle_minutes, so the job ends and its backend lets the machines go as after any job
(SkyPilot's autostop with down, dstack's idle_duration, the end of a Slurm allocation).
`idle_minutes: none` holds it until `rlx down`.

A job is what Ray's Jobs API lists (GET /api/jobs/ on the head's dashboard): jobs submitted
with `rlx launch -b ray` or `ray job submit`, and drivers that connected with `ray.init`. A
dashboard that does not answer counts as no job: nothing can be submitted through it.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlx.recipe import Recipe

POLL_SECONDS = 30.0
# Ray's JobStatus values of a job that has not ended.
ACTIVE = frozenset({"PENDING", "RUNNING"})


def active_jobs(url: str, token: str | None, timeout: float = 10.0) -> int:
    """How many of the jobs Ray's dashboard at `url` lists have not ended (OSError or
    ValueError when it does not answer with its list)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(f"{url}/api/jobs/", headers=headers)
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        jobs = json.load(answer)
    if not isinstance(jobs, list):
        raise ValueError(f"not a list of jobs: {str(jobs)[:80]}")
    return sum(1 for job in jobs if isinstance(job, dict) and job.get("status") in ACTIVE)


def dashboard_host(bound: str) -> str:
    """Where the head reaches its own dashboard: the address it binds, or the loopback for
    one bound to every address."""
    if bound in ("", "0.0.0.0", "::"):
        return "127.0.0.1"
    return f"[{bound}]" if ":" in bound else bound


def hold(
    idle_minutes: int | None,
    count_active: Callable[[], int],
    say: Callable[[str], None],
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    poll_seconds: float = POLL_SECONDS,
) -> int:
    """Hold until no job has been active for idle_minutes (None: for ever); 0 then."""
    if idle_minutes is None:
        say("rlx: holding the cluster until `rlx down` (resources.idle_minutes: none)")
        while True:
            sleep(3600.0)
    say(
        f"rlx: holding the cluster until no Ray job has run or waited on it for {idle_minutes} "
        "minutes (resources.idle_minutes)"
    )
    limit = idle_minutes * 60.0
    last_active = clock()
    unanswered = False
    while True:
        try:
            busy = count_active() > 0
            unanswered = False
        except (OSError, ValueError) as exc:
            if not unanswered:
                say(f"rlx: Ray's dashboard does not list its jobs ({exc}); counted as idle")
            busy, unanswered = False, True
        now = clock()
        if busy:
            last_active = now
        elif now - last_active >= limit:
            say(
                f"rlx: no Ray job for {idle_minutes} minutes (resources.idle_minutes); "
                "ending the kept cluster"
            )
            return 0
        sleep(poll_seconds)


def main(recipe: Recipe, env: Mapping[str, str]) -> int:
    """Hold the cluster of `recipe` (on its head, with the job's token in the environment)."""
    minutes = recipe.resources.idle_minutes
    url = f"http://{dashboard_host(recipe.ray.dashboard_host)}:{recipe.ray.dashboard_port}"
    token = env.get("RAY_AUTH_TOKEN")

    def say(line: str) -> None:
        print(line, flush=True)

    return hold(None if minutes == "none" else minutes, lambda: active_jobs(url, token), say)
