"""A probe job on emulated hosts (three, or the two a scenario needs), whichever backend
renders it.

The recipe's head command is tests/support/hosts/probe.py; a Job starts attempts of the rendered
job (SkyPilot and dstack host by host, Slurm through sbatch), waits for the head and the
workers, reads each node's log and can kill an attempt outright. Used by
tests/hosts/test_multinode.py and bench/bringup.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from rlx.launchers.base import collect_secrets
from rlx.recipe import Recipe, parse_recipe
from tests.support.hosts.netns import Host
from tests.support.hosts.rendered import REPO, NodeRun, RenderedJob, slurm_job_dir, submit_slurm
from tests.support.hosts.slurm import SlurmCluster

PROBE = REPO / "tests" / "support" / "hosts" / "probe.py"
JOIN_TIMEOUT = 240  # a hang bound: three Ray starts share two loaded cores (a raylet can miss
# Ray's 30 s and start again, a minute each on a busy machine)
RUN_TIMEOUT = 240.0  # a whole attempt, against hangs

T = TypeVar("T")


def probe_recipe(out: Path, join_timeout: int = JOIN_TIMEOUT, nodes: int = 3) -> Recipe:
    """`nodes` nodes, token auth (the default), the probe as the head command."""
    command = " ".join(
        shlex.quote(part) for part in (sys.executable, str(PROBE), "--out", str(out))
    )
    text = yaml.safe_dump(
        {
            "name": "probe",
            "resources": {"nodes": nodes},
            "command": [command],
            "ray": {"join_timeout": join_timeout},
        }
    )
    return parse_recipe(text, "probe.yaml").recipe


# A wait that sees its job move (`progress` changes) goes on up to this many times its own
# timeout: on a loaded machine a bring-up can outlast a fixed bound while it still advances.
PROGRESS_FACTOR = 3


def poll(
    predicate: Callable[[], T],
    timeout: float,
    what: str,
    interval: float = 0.1,
    progress: Callable[[], object] | None = None,
) -> T:
    """Poll until `predicate()` is truthy and return it; AssertionError naming `what` once
    `timeout` seconds pass with nothing new from `progress` (its value unchanged; without
    one, `timeout` seconds in all), and at PROGRESS_FACTOR x timeout whatever it says."""
    started = time.monotonic()
    deadline = started + timeout
    last = progress() if progress is not None else None
    checked = started
    while True:
        value = predicate()
        if value:
            return value
        now = time.monotonic()
        if progress is not None and now - checked >= 1.0:
            checked, seen = now, progress()
            if seen != last:
                last, deadline = seen, min(now + timeout, started + PROGRESS_FACTOR * timeout)
        if now > deadline:
            raise AssertionError(f"timed out after {now - started:.0f} s waiting for {what}")
        time.sleep(interval)


def program(cmdline: str) -> str:
    return cmdline.split(" ", 1)[0].rsplit("/", 1)[-1]


def is_slurm_daemon(cmdline: str) -> bool:
    return program(cmdline) in ("slurmd", "slurmstepd")


def leftovers(host: Host) -> list[str]:
    """What still runs on `host` besides Slurm's own daemons."""
    return [p.cmdline for p in host.processes() if not is_slurm_daemon(p.cmdline)]


def ray_processes(host: Host, name: str) -> list[int]:
    """PIDs (root namespace) of Ray's `name` processes (raylet, gcs_server) on `host`."""
    return [p.pid for p in host.processes() if program(p.cmdline) == name]


# `ray start` as the `ray` command runs it, or as rlx runs it (rlx.node.raynode.launch_argv).
RAY_START = r"((^|/)ray|-m rlx\.node\.raystart) start( |$)"


def ray_start_running(host: Host) -> bool:
    """Whether a `ray start` command still runs on `host` (it may outlive the moment its
    node is ALIVE, and until it exits the daemons it started are its children)."""
    return any(re.search(RAY_START, p.cmdline) for p in host.processes())


def assert_nothing_left(hosts: Sequence[Host], timeout: float = 30) -> None:
    """Every host is clean but for Slurm's daemons (processes may take a moment to exit)."""

    def clean() -> bool:
        return not any(leftovers(host) for host in hosts)

    try:
        poll(clean, timeout, "every host to be clean")
    except AssertionError:
        left = {host.name: leftovers(host) for host in hosts}
        raise AssertionError(f"processes left running: {left}") from None


def kill_leftovers(hosts: Sequence[Host]) -> None:
    """SIGKILL everything on the hosts but Slurm's daemons."""
    for host in hosts:
        for proc in host.processes():
            if not is_slurm_daemon(proc.cmdline):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)


def alive_ips(probe: dict[str, Any]) -> list[str]:
    return sorted(n["ip"] for n in probe["nodes"] if n["alive"])


@dataclass
class Run:
    """One attempt of a job on the hosts, whichever backend started it."""

    attempt: int
    started: float = field(default_factory=time.monotonic)
    nodes: list[NodeRun] = field(default_factory=list)  # sky, dstack: one per started host
    job_id: int | None = None  # slurm
    job_exit_code: int | None = None  # slurm, once finished


HEAD_DONE = "rlx: head finished with exit code "
WORKERS_DONE = "rlx: workers finished with exit code "


class Job:
    """A probe job on `hosts`, one node each (on Slurm, those of the cluster's hosts):
    start attempts, wait for outcomes, read node logs."""

    def __init__(
        self,
        backend: str,
        hosts: Sequence[Host],
        workdir: Path,
        cluster: SlurmCluster | None = None,
        join_timeout: int = JOIN_TIMEOUT,
    ) -> None:
        if backend == "slurm" and cluster is None:
            raise ValueError("a Slurm job needs the cluster")
        self.backend = backend
        self.hosts = hosts
        self.workdir = workdir
        self.cluster = cluster
        self.out = workdir / "probe"
        self.out.mkdir(exist_ok=True)
        self.recipe = probe_recipe(self.out, join_timeout, nodes=len(hosts))
        self.rendered = (
            None
            if backend == "slurm"
            else RenderedJob.from_recipe(backend, self.recipe, hosts, workdir)
        )
        # What `rlx launch` does for SkyPilot and dstack: a fresh Ray token for this job.
        # (The Slurm script makes its own.)
        self.secrets = collect_secrets(self.recipe, {})
        self.attempts = 0

    def control(self, **settings: object) -> None:
        """What the probe does in the next attempt: exit=<code>, hold=True."""
        (self.out / "control.json").write_text(json.dumps(settings))

    def start(self, *, stalled: Sequence[int] = ()) -> Run:
        """Start one attempt on every host; hosts in `stalled` never get to `rlx node`."""
        self.attempts += 1
        run = Run(self.attempts)
        if self.rendered is not None:
            # The same task id on a retry, as SkyPilot keeps it across recoveries.
            run.nodes = self.rendered.start_all(
                self.secrets, task_id="task-1", attempt=run.attempt, skip=tuple(stalled)
            )
        else:
            assert self.cluster is not None
            names = " ".join(self.hosts[rank].name for rank in stalled)
            run.job_id = submit_slurm(
                self.cluster,
                self.recipe,
                self.workdir,
                extra_env={"RLX_TEST_STALLED_HOSTS": names},
                nodelist=[host.name for host in self.hosts],
            )
        return run

    # ---------------------------------------------------------------- one attempt

    def job_dir(self, run: Run) -> Path:
        assert run.job_id is not None
        return slurm_job_dir(self.workdir, self.recipe, run.job_id)

    def log(self, run: Run, rank: int) -> str:
        """What node `rank` printed in this attempt ("" if it never started)."""
        if run.job_id is None:
            return next((n.output() for n in run.nodes if n.host.rank == rank), "")
        name = "head.log" if rank == 0 else f"worker-{self.hosts[rank].name}.log"
        path = self.job_dir(run) / name
        return path.read_text(errors="replace") if path.exists() else ""

    def driver_log(self, run: Run) -> str:
        path = self.job_dir(run) / "driver.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def all_logs(self, run: Run) -> str:
        parts = [f"--- node {rank}\n{self.log(run, rank)}" for rank in range(len(self.hosts))]
        if run.job_id is not None:
            parts.append(f"--- driver\n{self.driver_log(run)}")
        return "\n".join(parts)

    def wait_holding(self, run: Run, timeout: float = RUN_TIMEOUT) -> None:
        """Until the probe holds in this attempt (every node joined, the trainer started):
        `timeout` seconds without a new line from any node, so a bring-up that a loaded
        machine slows but still advances is waited for (poll's PROGRESS_FACTOR bounds it)."""
        poll(
            lambda: (self.out / f"holding-{run.attempt}").exists(),
            timeout,
            "the trainer to start",
            progress=lambda: self.all_logs(run),
        )

    def head_started(self, run: Run, timeout: float = 60) -> float:
        """When the head's run block started (Slurm: when its step's log appeared)."""
        if run.job_id is None:
            return run.started
        head_log = self.job_dir(run) / "head.log"
        poll(head_log.exists, timeout, "the head step to start", interval=0.02)
        return time.monotonic()

    def _driver_code(self, run: Run, prefix: str) -> int | None:
        for line in self.driver_log(run).splitlines():
            if line.startswith(prefix):
                return int(line.rsplit(" ", 1)[1])
        return None

    def wait_head(self, run: Run, timeout: float = RUN_TIMEOUT) -> tuple[int, float]:
        """The head's exit code and when it ended (monotonic)."""
        if run.job_id is None:
            head = next((n for n in run.nodes if n.host.rank == 0), None)
            assert head is not None, "the head was not started"
            return head.wait(timeout), time.monotonic()
        poll(
            lambda: self._driver_code(run, HEAD_DONE) is not None,
            timeout,
            "the head step to finish",
            interval=0.02,
            progress=lambda: self.all_logs(run),
        )
        ended = time.monotonic()
        code = self._driver_code(run, HEAD_DONE)
        assert code is not None
        return code, ended

    def wait_all(self, run: Run, timeout: float = RUN_TIMEOUT) -> dict[int, int]:
        """Exit codes by rank once every started node is done. Slurm: the head step's code
        at rank 0 and the workers' step code (the highest of its tasks) at every worker;
        the job's own exit code goes to run.job_exit_code."""
        if run.job_id is None:
            return {node.host.rank: node.wait(timeout) for node in run.nodes}
        assert self.cluster is not None
        run.job_exit_code = self.cluster.wait_job(run.job_id, timeout=timeout).exit_code
        codes = {}
        head = self._driver_code(run, HEAD_DONE)
        if head is not None:
            codes[0] = head
        workers = self._driver_code(run, WORKERS_DONE)
        if workers is not None:
            codes.update(dict.fromkeys(range(1, len(self.hosts)), workers))
        return codes

    def kill_attempt(self, run: Run) -> None:
        """SIGKILL the run blocks, as a crashed job runner would leave them: the Ray
        daemons they started stay behind."""
        if run.job_id is None:
            for node in run.nodes:
                node.proc.kill_tree()
                node.proc.wait(timeout=30)
            return
        assert self.cluster is not None
        self.cluster.command(["scancel", "--full", "--signal=KILL", str(run.job_id)])
        self.cluster.wait_job(run.job_id, timeout=120)

    def probe(self, attempt: int) -> dict[str, Any]:
        """What the probe saw in `attempt` (see tests/support/hosts/probe.py)."""
        return json.loads((self.out / f"probe-{attempt}.json").read_text())
