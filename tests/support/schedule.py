"""The order `make test` runs in (pytest-xdist, `--dist loadfile`), longest first.

A unit of work is a module (its tests run in order on one worker and may share module
fixtures), except under tests/hosts/, where every test is a unit of its own: host tests
share no state wider than a test, or the session (conftest refuses a module fixture there);
and in the modules of SPLIT, whose tests are long enough that one worker running them all
would be the whole run's last half hour: each is a unit, and a worker that takes one sets
the module's fixtures up for itself (a few seconds against minutes a test).
Units go out longest first, by the seconds tests/timings.json records for their tests, so
the longest tests start at once and the last minutes are short tests on every worker, not
one long test on one; a test the file does not know counts by its tier (a host test as a
long one: it is new, and new host tests are rarely short). A worker is given its next unit
only when the one it runs has one test left: nothing long waits behind a busy worker while
another is free.

Refresh the file after adding slow tests: `make test PYTEST_ADDOPTS=--durations=0 | tee
log`, then `python -m tests.support.schedule log`.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

TIMINGS = Path(__file__).resolve().parent.parent / "timings.json"
# A test the file does not know (a new one), by tier: a host test is rarely short, a unit
# test always is.
UNKNOWN_SECONDS = {"hosts": 60.0, "integration": 5.0, "unit": 0.1}
DURATION = re.compile(r"^\s*([0-9.]+)s (?:setup|call|teardown)\s+(\S.*?)\s*$")


# Modules whose tests are each a unit of their own. Empty: the dress rehearsals (2-15
# minutes each) were one such module, and run so, a rehearsal could meet a worker whose
# process had used other Ray clusters before, where its training workers' owner (the
# in-process driver) was taken for dead within seconds in two CI runs; as one module
# they start first, in a fresh worker, and pass.
SPLIT: frozenset[str] = frozenset()


def unit_of(nodeid: str) -> str:
    module = nodeid.partition("::")[0]
    return nodeid if module.startswith("tests/hosts/") or module in SPLIT else module


def expected_seconds(timings: dict[str, float], nodeid: str) -> float:
    if nodeid in timings:
        return timings[nodeid]
    tier = nodeid.split("/")[1] if nodeid.startswith("tests/") else ""
    return UNKNOWN_SECONDS.get(tier, UNKNOWN_SECONDS["integration"])


def load_timings() -> dict[str, float]:
    try:
        return {k: float(v) for k, v in json.loads(TIMINGS.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadFileScheduling

    timings = load_timings()

    class LongestFirst(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

        def schedule(self) -> None:
            if self.collection is not None:  # called again: more workers joined
                for node in self.nodes:
                    self._reschedule(node)
                return
            if not self._check_nodes_have_same_collection():
                self.log("**Different tests collected, aborting run**")
                return
            self.collection = list(next(iter(self.registered_collections.values())))
            units: dict[str, dict[str, bool]] = {}
            for nodeid in self.collection:
                units.setdefault(self._split_scope(nodeid), {})[nodeid] = False
            for scope, tests in sorted(
                units.items(),
                key=lambda unit: -sum(expected_seconds(timings, t) for t in unit[1]),
            ):
                self.workqueue[scope] = tests
            for node in self.nodes:
                if self.workqueue:
                    self._assign_work_unit(node)
            for node in self.nodes:
                self._reschedule(node)

        def _reschedule(self, node: Any) -> None:
            if node.shutting_down:
                return
            if not self.workqueue:
                node.shutdown()
                return
            # A worker runs a test once it holds the next one too: so it needs a new unit
            # when one test is left, and not before.
            if self._pending_of(self.assigned_work[node]) > 1:
                return
            self._assign_work_unit(node)

    return LongestFirst(config, log)


def timings_from_log(lines: list[str]) -> dict[str, float]:
    """Each test's setup + call + teardown seconds from a `--durations=0` report."""
    seconds: dict[str, float] = {}
    for line in lines:
        match = DURATION.match(line)
        if match:
            nodeid = match.group(2)
            seconds[nodeid] = round(seconds.get(nodeid, 0.0) + float(match.group(1)), 1)
    return seconds


if __name__ == "__main__":
    found = timings_from_log(Path(sys.argv[1]).read_text().splitlines())
    if not found:
        sys.exit(f"{sys.argv[1]}: no `--durations=0` lines found")
    TIMINGS.write_text(json.dumps(found, indent=0, sort_keys=True) + "\n")
    print(f"{TIMINGS}: {len(found)} tests, {sum(found.values()):.0f} s in all")
