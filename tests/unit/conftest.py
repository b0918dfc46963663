"""The unit tier: no process, no Ray, no server, no emulated host. A unit test that starts a
process (subprocess, multiprocessing, fork: Ray and every server start that way) or asks for
a fixture that runs one fails here and says where it belongs."""

from __future__ import annotations

import contextlib
import multiprocessing.process
import os
import subprocess

import pytest

# Fixtures that start processes or servers: tests that use them are integration or hosts tests.
PROCESS_FIXTURES = {
    "local_ray",
    "gpu_ray",
    "dstack_server",
    "emulated_hosts",
    "hosts_factory",
    "slurm_session",
    "slurm_cluster",
}
# matplotlib lists the machine's fonts (fc-list, a process) the first time it is imported on
# a machine and caches them; import it here, before the guard, so a unit test that plots
# does not trip the guard on a fresh machine.
with contextlib.suppress(ImportError):  # without matplotlib the plots' own tests say so
    import matplotlib.font_manager  # noqa: F401

MOVE = "a unit test starts no process; move it to tests/integration (or tests/hosts)"


@pytest.fixture(autouse=True)
def _no_processes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    used = PROCESS_FIXTURES & set(request.fixturenames)
    if used:
        pytest.fail(f"{MOVE}: it uses {', '.join(sorted(used))}", pytrace=False)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"{MOVE} (it started {args[1:2] or 'a process'})")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    monkeypatch.setattr(os, "fork", refuse)
