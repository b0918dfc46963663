"""The CPU each test costs, everything it started included: a measurement, not a test.

The suite is CPU-bound on 2 cores, so what to trim is the CPU a test needs, not the seconds it
took beside others. Run as root on a machine with cgroup v1's cpuacct controller mounted:

    make test PYTEST_ADDOPTS="-p tests.support.cpuacct"
    python -m tests.support.cpuacct [N]     # the N costliest modules and tests

Each test runs in a cpuacct group of its own (its worker moves in for the test and out after
it), and so does every process started during the test: Ray's daemons, training workers,
vLLM engines, servers. A module fixture's processes count toward the module's first test,
until they end; what a daemon started outside the test process tree (slurmd's jobs) counts
nowhere. The groups stay until the machine restarts, so the report reads their final use.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path("/sys/fs/cgroup/cpuacct/rlx-tests")
RECORDS = Path("/tmp/rlx-cpuacct")
_count = itertools.count()


def _enter(group: Path) -> None:
    group.mkdir(parents=True, exist_ok=True)
    (group / "cgroup.procs").write_text(str(os.getpid()))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    name = f"w{os.getpid()}-{next(_count)}"
    try:
        _enter(ROOT / name)
    except OSError:  # no cpuacct here, or not root: nothing measured
        yield
        return
    yield
    _enter(ROOT / f"w{os.getpid()}-between")
    RECORDS.mkdir(exist_ok=True)
    with (RECORDS / f"{os.getpid()}.jsonl").open("a") as out:
        out.write(json.dumps({"test": item.nodeid, "group": name}) + "\n")


def cpu_seconds() -> dict[str, float]:
    """Each measured test's CPU seconds so far."""
    found = {}
    for path in RECORDS.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            usage = ROOT / record["group"] / "cpuacct.usage"
            if usage.is_file():
                found[record["test"]] = int(usage.read_text()) / 1e9
    return found


def main(argv: list[str]) -> None:
    top = int(argv[0]) if argv else 25
    tests = cpu_seconds()
    modules: collections.Counter[str] = collections.Counter()
    for test, seconds in tests.items():
        modules[test.partition("::")[0]] += seconds
    print(f"{len(tests)} tests, {sum(tests.values()):.0f} CPU-s")
    for module, seconds in modules.most_common(top):
        print(f"{seconds:8.0f}  {module}")
    print()
    for test, seconds in sorted(tests.items(), key=lambda item: -item[1])[:top]:
        print(f"{seconds:8.0f}  {test}")


if __name__ == "__main__":
    main(sys.argv[1:])
