"""The rendered jobs form real Ray clusters across emulated hosts, and fail fast.

Every scenario runs the RENDERED output of a recipe whose head command is a probe
(tests/support/hosts/probe.py): SkyPilot's run block and dstack's commands on each host with that
backend's environment, and the Slurm batch script through `sbatch` on a real Slurm. Ray
token authentication is on, with a fresh token per job, delivered as each backend would
(the process environment for SkyPilot and dstack; the Slurm script makes its own).

SkyPilot's and dstack's run blocks differ only in how a node learns its rank, the node count
and the head's address; past that both run the same `rlx node`. So each failure scenario runs
on Slurm where Slurm changes its outcome (one step holding both workers, a job's exit code, the
kill that takes Ray's daemons down) and on one of the other two, the two taking turns: every
backend's run block meets two scenarios, and the suite pays for seven, not twelve.

A scenario runs on three hosts where a third changes what it proves (a node missing while
another joined; workers that both wait on the head) and on two where it does not (a retry, a
lost worker): each host costs its Ray daemons, again at every attempt.

Measured failure-detection times are printed (`-s` shows them). The timing assertions are
the bounds the bootstrap promises (join timeout + 10 s, a lost node under 30 s) and
generous ones against hangs.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlx.node.bootstrap import CLUSTER_FAILURE
from tests.support.hosts import Hosts, SlurmCluster
from tests.support.hosts.probejob import (
    RUN_TIMEOUT,
    Job,
    alive_ips,
    assert_nothing_left,
    kill_leftovers,
    poll,
    ray_processes,
    ray_start_running,
)
from tests.support.hosts.rendered import REPO, node_base_env

pytest.importorskip("ray")
pytestmark = [pytest.mark.hosts, pytest.mark.timeout(600)]

BACKENDS = ["sky", "dstack", "slurm"]
# A node never shows up: long enough for the others to join on a loaded 2-core machine (at
# the suite's start three Ray clusters come up at once: 30 s was seen to be too short, and
# 60 s once, when the head's own `ray start` took 59 s of it). Mostly idle waiting.
MISSING_JOIN_TIMEOUT = 90
HEADLESS_JOIN_TIMEOUT = 15  # the head never comes up: the workers start no Ray meanwhile
RAY_PORT = 6379  # the recipe default


def report(label: str, seconds: float) -> None:
    print(f"\n[multinode] {label}: {seconds:.1f} s")


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "sky":
        pytest.importorskip("sky")
    if request.param == "dstack":
        pytest.importorskip("dstack")
    return request.param


@pytest.fixture
def make_job(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator:
    """Make a probe Job on `nodes` hosts: fresh ones (sky, dstack) or those of the session's
    Slurm."""
    cluster: SlurmCluster | None = None
    if backend == "slurm":
        cluster = request.getfixturevalue("slurm_cluster")
        hosts = cluster.hosts
    else:
        hosts = request.getfixturevalue("emulated_hosts")

    def make(join_timeout: int | None = None, nodes: int = 3) -> Job:
        kwargs = {} if join_timeout is None else {"join_timeout": join_timeout}
        return Job(backend, hosts[:nodes], tmp_path, cluster, **kwargs)

    yield make
    if cluster is not None:
        # The Slurm hosts outlive this test: leave nothing of it on them.
        (tmp_path / "probe" / "release").touch()
        cluster.cancel_all()
        kill_leftovers(hosts)


def test_hosts_run_this_checkouts_rlx(emulated_hosts: Hosts, tmp_path: Path) -> None:
    done = emulated_hosts[1].run(
        "command -v rlx && rlx node --help >/dev/null && "
        "python -c 'import rlx.node.bootstrap as b; print(b.__file__)'",
        env=node_base_env(tmp_path),
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [
        str(tmp_path / "bin" / "rlx"),
        str(REPO / "rlx" / "node" / "bootstrap.py"),
    ]


def backends(*names: str):
    """Run a scenario on these backends only (see the module's docstring)."""
    return pytest.mark.parametrize("backend", names, indirect=True)


@backends("sky", "slurm")
def test_a_node_that_never_starts_is_named(make_job) -> None:
    job = make_job(join_timeout=MISSING_JOIN_TIMEOUT)
    job.control(exit=0)
    run = job.start(stalled=(2,))
    started = job.head_started(run)
    code, ended = job.wait_head(run)
    logs = job.all_logs(run)
    report(f"{job.backend}: missing node reported after", ended - started)
    assert code == CLUSTER_FAILURE, logs
    assert ended - started < MISSING_JOIN_TIMEOUT + 10, logs
    missing = job.hosts[2]
    head_log = job.log(run, 0)
    assert f"did not form within {MISSING_JOIN_TIMEOUT} s" in head_log, logs
    assert "missing node 2 (" in head_log and missing.ip in head_log, logs
    assert "node 1 (" not in head_log.split("missing", 1)[1], logs  # only the missing one
    assert not list(job.out.glob("started-*")), "the trainer started without every node"
    codes = job.wait_all(run)
    logs = job.all_logs(run)
    assert "the head finished with exit code 75; leaving" in job.log(run, 1), logs
    if job.backend == "slurm":
        # One step holds both workers: the stalled one is stopped after the grace period.
        assert run.job_exit_code == CLUSTER_FAILURE, logs
        assert "node2: task 0: Exited with exit code 75" in job.driver_log(run), logs
    else:
        assert codes[1] == CLUSTER_FAILURE, logs
    assert_nothing_left(job.hosts)


@backends("dstack", "slurm")
def test_workers_give_up_when_the_head_never_comes_up(make_job) -> None:
    job = make_job(join_timeout=HEADLESS_JOIN_TIMEOUT)
    job.control(exit=0)
    run = job.start(stalled=(0,))
    if job.backend == "slurm":  # time the workers from when their step starts
        worker_logs = [job.job_dir(run) / f"worker-{h.name}.log" for h in job.hosts[1:]]
        poll(lambda: all(p.exists() for p in worker_logs), 60, "the worker steps")
    started = time.monotonic()

    def gave_up() -> bool:
        return all("did not come up" in job.log(run, rank) for rank in (1, 2))

    poll(gave_up, HEADLESS_JOIN_TIMEOUT + 60, "the workers to give up", interval=0.05)
    elapsed = time.monotonic() - started
    report(f"{job.backend}: workers gave up on the head after", elapsed)
    codes = job.wait_all(run)
    logs = job.all_logs(run)
    assert elapsed < HEADLESS_JOIN_TIMEOUT + 10, logs
    assert codes[1] == codes[2] == CLUSTER_FAILURE, logs
    for rank in (1, 2):
        text = job.log(run, rank)
        assert "the head (node 0 (" in text and job.hosts[0].ip in text, logs
        assert f"did not come up on port {RAY_PORT} within {HEADLESS_JOIN_TIMEOUT} s" in text, logs
        assert "Traceback" not in text, logs
    if job.backend == "slurm":
        # The driver does not wait forever on a head that never came up.
        assert run.job_exit_code == CLUSTER_FAILURE, logs
    assert not list(job.out.glob("started-*"))
    assert_nothing_left(job.hosts)


@backends("dstack")
def test_a_lost_worker_fails_the_job_fast(make_job) -> None:
    job = make_job(nodes=2)
    job.control(hold=True)
    run = job.start()
    job.wait_holding(run)
    victim = job.hosts[1]
    raylets = ray_processes(victim, "raylet")
    assert len(raylets) == 1, victim.processes()
    os.kill(raylets[0], signal.SIGKILL)
    killed = time.monotonic()
    code, ended = job.wait_head(run)
    logs = job.all_logs(run)
    report(f"{job.backend}: lost worker detected after", ended - killed)
    assert code == CLUSTER_FAILURE, logs
    assert ended - killed < 30, logs
    head_log = job.log(run, 0)
    assert "lost node 1 (" in head_log and victim.ip in head_log, logs
    codes = job.wait_all(run)
    logs = job.all_logs(run)
    assert codes == {0: CLUSTER_FAILURE, 1: CLUSTER_FAILURE}, logs
    assert "Ray stopped on this node" in job.log(run, 1), logs
    assert_nothing_left(job.hosts)


@backends("sky", "slurm")
@pytest.mark.timeout(2400)  # three attempts whose waits may each stretch while they advance
def test_a_retried_job_starts_clean(make_job) -> None:
    """The run block runs three times on the same two hosts: a failed attempt (both nodes
    joined and the trainer ran, from the head; its exit code is every node's and the job's),
    then one killed outright (its Ray daemons left running), then one that succeeds. Each
    retry forms one fresh cluster, and the last trainer's success is the job's."""
    job = make_job(nodes=2)
    # Attempt 1: the trainer fails.
    job.control(exit=3)
    first_run = job.start()
    codes = job.wait_all(first_run)
    logs = job.all_logs(first_run)
    assert codes == {0: 3, 1: 3}, logs
    if job.backend == "slurm":
        assert first_run.job_exit_code == 3, logs
    probe = job.probe(1)
    # The trainer started once both nodes were ALIVE, each from its own address.
    assert alive_ips(probe) == sorted(h.ip for h in job.hosts), probe
    assert len(probe["nodes"]) == 2, probe
    assert probe["hostname"] == "node1"
    assert probe["env"]["RAY_ADDRESS"] == f"{job.hosts[0].ip}:{RAY_PORT}"
    assert probe["env"]["RLX_NUM_NODES"] == "2"
    assert probe["env"]["RAY_AUTH_MODE"] == "token" and probe["token_set"], probe
    assert "all 2 nodes joined" in job.log(first_run, 0), logs
    assert "the head finished with exit code 3; leaving" in job.log(first_run, 1), logs
    assert_nothing_left(job.hosts)

    # Attempt 2: a fresh cluster after the failure, then the attempt killed outright.
    job.control(hold=True)
    killed = job.start()
    poll(
        lambda: (job.out / "holding-2").exists(),
        RUN_TIMEOUT,
        "the retried trainer",
        progress=lambda: job.all_logs(killed),
    )
    assert_one_fresh_cluster(job, killed, 2)
    # A worker's node is ALIVE a moment before its `ray start` exits; killed before then,
    # the daemons would go down with it, which is not the case under test.
    poll(
        lambda: not any(ray_start_running(h) for h in job.hosts),
        RUN_TIMEOUT,
        "every `ray start` to finish",
    )
    job.kill_attempt(killed)
    if job.backend == "slurm":
        # Slurm signals each task's process group, which the daemons `ray start` leaves
        # behind belong to: they go down with the job.
        assert_nothing_left(job.hosts)
    else:
        # Killed outright, every host keeps the Ray daemons of the killed attempt.
        for host in job.hosts:
            assert len(ray_processes(host, "raylet")) == 1, host.processes()

    # Attempt 3: a fresh cluster again, whose trainer's success is the job's.
    job.control(hold=True)
    last = job.start()
    poll(
        lambda: (job.out / "holding-3").exists(),
        RUN_TIMEOUT,
        "the trainer after the kill",
        progress=lambda: job.all_logs(last),
    )
    logs = assert_one_fresh_cluster(job, last, 3)
    if job.backend != "slurm":
        for rank in range(2):
            assert "left by an earlier attempt" in job.log(last, rank), logs
    (job.out / "release").touch()
    codes = job.wait_all(last)
    logs = job.all_logs(last)
    assert codes == {0: 0, 1: 0}, logs
    if job.backend == "slurm":
        assert last.job_exit_code == 0, logs
    assert "the head finished with exit code 0; leaving" in job.log(last, 1), logs
    assert_nothing_left(job.hosts)


def assert_one_fresh_cluster(job, run, attempt: int) -> str:
    """One Ray per host, not two, and only this attempt's nodes, all alive: nothing of an
    earlier attempt is counted. The attempt's logs."""
    logs = job.all_logs(run)
    for host in job.hosts:
        assert len(ray_processes(host, "raylet")) == 1, (host.processes(), logs)
    assert len(ray_processes(job.hosts[0], "gcs_server")) == 1, logs
    probe = job.probe(attempt)
    assert alive_ips(probe) == sorted(h.ip for h in job.hosts), probe
    assert len(probe["nodes"]) == len(job.hosts), probe
    return logs
