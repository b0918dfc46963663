"""`rlx launch --backend slurm` on a real Slurm across emulated hosts: the quickstart trains
to completion on 2 nodes, `rlx status` and `rlx logs` follow it, and `rlx down` stops a
second job leaving nothing behind on any host."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from tests.conftest import RECIPES
from tests.support.cli import run_rlx
from tests.support.hosts.rendered import node_base_env
from tests.support.hosts.slurm import TERMINAL_STATES
from tests.support.slurm_jobs import launch_and_wait

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(1200)]


def quickstart(workdir: Path, name: str, steps: int) -> Path:
    """The shipped quickstart on 2 nodes, outputs on the cluster's shared filesystem."""
    recipe = yaml.safe_load((RECIPES / "quickstart.yaml").read_text())
    shared = str(workdir)
    recipe["name"] = name
    recipe["resources"]["nodes"] = 2
    recipe["volumes"] = [{"path": shared}]  # Slurm: already shared, no volume to attach
    recipe["ray"] = {"join_timeout": 300}  # a hang bound: a busy machine starts Ray slowly
    trainer = recipe["trainer"]
    trainer["steps"] = steps
    trainer["batch"]["prompts_per_step"] = 2  # 2 x 16 samples split over 2 nodes
    trainer["checkpoint"] = {"dir": f"{shared}/checkpoints", "every": 3, "keep": 2}
    trainer["logging"] = {"dir": f"{shared}/runs", "tensorboard": False}
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def rlx(workdir: Path, env: dict[str, str], *args: str, timeout: float = 120):
    return run_rlx(list(args), workdir, env=env, timeout=timeout)


def state_of(workdir: Path, env: dict[str, str], name: str) -> str:
    out = rlx(workdir, env, "status", name)
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if name in line)
    return re.split(r"\s*│\s*|\s{2,}", row.strip(" │"))[3]


def wait_state(workdir, env, name, states, timeout) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = state_of(workdir, env, name)
        if state in states:
            return state
        time.sleep(2)
    raise AssertionError(f"{name} did not reach {states} within {timeout} s (last: {state})")


def job_processes(cluster) -> list[str]:
    """What is left on the hosts besides the Slurm daemons themselves."""
    left = []
    for host in cluster.hosts:
        for proc in host.processes():
            if "slurmd" not in proc.cmdline and proc.state != "Z":
                left.append(f"{host.name}: {proc.cmdline}")
    return left


# A wait in the requeue test ends when what it waits for happens, and fails only once it no
# longer can: nothing the job writes (its logs, checkpoints) or Slurm reports (its state, the
# nodes') has changed for HANG seconds, or the job has ended. A loaded machine makes the job
# slower, not silent: a fixed budget for each wait was what load exceeded (a trainer still
# starting at 240 s).
HANG = 300.0
ENDED_GRACE = 20.0  # a predicate that comes true as the job ends is read within this


class JobWatch:
    """One Slurm job as the requeue test follows it: its queue state, the nodes' states and
    the files under its folders, polled until a condition holds or progress stops."""

    def __init__(self, job_id: str, env: dict[str, str], folders: tuple[Path, ...]) -> None:
        self.job_id, self.env, self.folders = job_id, env, folders

    def _run(self, *argv: str) -> str:
        done = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=60)
        return done.stdout.strip()

    def state(self) -> str:
        """squeue's state of the job (RUNNING, PENDING, ...); "" once Slurm no longer lists it."""
        return self._run("squeue", "-h", "-j", self.job_id, "-o", "%T")

    def node_states(self) -> list[str]:
        return self._run("sinfo", "-h", "-N", "-o", "%T").split()

    def _files(self) -> list[tuple[str, int]]:
        """Every file under the folders with its size. os.walk passes over what retention
        removes as it looks."""
        files = []
        for folder in self.folders:
            for root, _, names in os.walk(folder):
                for name in names:
                    path = os.path.join(root, name)
                    with contextlib.suppress(FileNotFoundError):
                        files.append((path, os.stat(path).st_size))
        return sorted(files)

    def report(self) -> str:
        logs = (p for folder in self.folders if folder.exists() for p in folder.rglob("*.log"))
        return "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-3000:]}" for p in logs)

    def wait(self, reached: Callable[[], bool], what: str) -> None:
        """Poll `reached` (which may act, as start_requeued_now does) until it holds."""
        seen: tuple[object, ...] = ()
        moved = time.monotonic()
        ended: float | None = None
        while not reached():
            now = time.monotonic()
            state = self.state()
            mark = (state, self.node_states(), self._files())
            if mark != seen:
                seen, moved = mark, now
            assert now - moved < HANG, (
                f"waiting for {what}: nothing moved for {HANG:.0f} s (job {state or 'gone'}, "
                f"nodes {mark[1]})\n{self.report()}"
            )
            if state in TERMINAL_STATES or not state:
                ended = ended if ended is not None else now
                assert now - ended < ENDED_GRACE, (
                    f"the job ended ({state or 'gone'}) before {what}\n{self.report()}"
                )
            else:
                ended = None
            time.sleep(1)


@pytest.fixture
def launch_env(slurm_cluster, tmp_path) -> dict[str, str]:
    env = {**os.environ, **slurm_cluster.env, **node_base_env(tmp_path)}
    return {k: v for k, v in env.items() if v != "" or k == "PATH"}


def test_quickstart_on_two_nodes_then_down(slurm_cluster, launch_env, tmp_path):
    """The quickstart on 2 Slurm nodes: both join, a training worker on each, progress and
    logs through rlx while it trains; stopped with rlx down, it leaves nothing running (a run
    that finishes: the requeue test)."""
    recipe = quickstart(tmp_path, "quick-slurm", steps=10_000)
    out = rlx(tmp_path, launch_env, "launch", str(recipe), "--backend", "slurm")
    assert out.returncode == 0, out.stderr
    assert "launched quick-slurm on slurm" in out.stderr

    # Progress from the run folder on the shared filesystem, once a checkpoint is written.
    deadline = time.monotonic() + 600
    while not list((tmp_path / "checkpoints").glob("*/step-000003/COMPLETE")):
        assert time.monotonic() < deadline, rlx(tmp_path, launch_env, "logs", "quick-slurm").stdout
        time.sleep(2)
    status = rlx(tmp_path, launch_env, "status", "quick-slurm").stdout
    assert re.search(r"step \d+ of 10000", status) and "elapsed" in status, status
    logs = rlx(tmp_path, launch_env, "logs", "quick-slurm")
    assert logs.returncode == 0
    head_log = logs.stdout
    assert "all 2 nodes joined" in head_log
    assert "cluster formed: 2/2 nodes online" in head_log
    ips = [host.ip for host in slurm_cluster.hosts]
    workers = re.search(r"training workers: (.*)", head_log)
    assert workers, head_log
    assert sum(ip in workers.group(1) for ip in ips) == 2  # a training worker on each node
    worker_log = rlx(tmp_path, launch_env, "logs", "quick-slurm", "--node", "1").stdout
    assert "joining the head" in worker_log, worker_log

    down = rlx(tmp_path, launch_env, "down", "quick-slurm")
    assert down.returncode == 0, down.stderr
    assert (
        wait_state(tmp_path, launch_env, "quick-slurm", {"CANCELLED", "FAILED"}, 120) == "CANCELLED"
    )
    deadline = time.monotonic() + 60
    while job_processes(slurm_cluster):
        assert time.monotonic() < deadline, job_processes(slurm_cluster)
        time.sleep(1)


def test_kept_cluster_attach_tunnel_and_down(slurm_cluster, launch_env, tmp_path):
    """--keep forms the cluster and holds it; attach runs on the head and on worker 1 with
    the job's Ray; a -b ray job goes through `rlx tunnel` (srun); down frees the nodes."""
    path = tmp_path / "kept.yaml"
    path.write_text(
        yaml.safe_dump({"name": "kept", "resources": {"nodes": 3}, "ray": {"join_timeout": 300}})
    )
    started = time.monotonic()
    out = rlx(tmp_path, launch_env, "launch", str(path), "-b", "slurm", "--keep")
    assert out.returncode == 0, out.stderr
    assert "rlx tunnel kept --port 8265" in out.stderr and "rlx attach kept" in out.stderr
    token_file = tmp_path / ".rlx" / "tokens" / "kept"
    assert token_file.stat().st_mode & 0o077 == 0
    # Wait on the head's log itself (an `rlx logs` a second costs a CPU-second each while
    # the cluster forms), then read it once through rlx.
    deadline = time.monotonic() + 300
    head_logs = tmp_path / "rlx-logs"
    while not any("rlx: cluster kept" in _read(p) for p in head_logs.glob("kept-*/head.log")):
        assert time.monotonic() < deadline, rlx(tmp_path, launch_env, "logs", "kept").stdout
        time.sleep(1)
    print(f"\n[slurm-keep] cluster formed and kept after {time.monotonic() - started:.1f} s")
    kept_log = rlx(tmp_path, launch_env, "logs", "kept")
    assert "rlx: cluster kept" in kept_log.stdout, kept_log.stdout + kept_log.stderr

    # `ray status` shows the autoscaler's report, refreshed every few seconds: right after
    # the head saw every node join (its own check reads the node table) it may still list
    # only the head, so ask again until the report catches up.
    t0 = time.monotonic()
    deadline = t0 + 90
    while True:
        status = rlx(tmp_path, launch_env, "attach", "kept", "--", "ray", "status")
        assert status.returncode == 0, status.stderr + status.stdout
        active = status.stdout.split("Active:", 1)[1].split("Pending:", 1)[0]
        if active.count("node_") == 3:
            break
        assert time.monotonic() < deadline, status.stdout
        time.sleep(2)
    print(f"[slurm-keep] rlx attach kept -- ray status: {time.monotonic() - t0:.1f} s")
    host = rlx(tmp_path, launch_env, "attach", "kept", "--node", "1", "--", "hostname")
    assert host.returncode == 0 and host.stdout.strip() == "node2", host
    env = rlx(tmp_path, launch_env, "attach", "kept", "--node", "2", "--", "sh", "-c", "exit 4")
    assert env.returncode == 4
    bad = rlx(tmp_path, launch_env, "attach", "kept", "--node", "3", "--", "true")
    assert bad.returncode == 1 and "has nodes 0..2" in bad.stderr

    # A Ray job from this machine, through the srun port forward to the head's dashboard.
    port = 18265 + os.getpid() % 1000
    forward = subprocess.Popen(
        [sys.executable, "-m", "rlx", "tunnel", "kept", "--port", str(port)],
        cwd=tmp_path,
        env=launch_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert "rlx: 127.0.0.1:" in forward.stdout.readline()
        job = tmp_path / "hello.yaml"
        job.write_text(yaml.safe_dump({"name": "hello", "command": ["hostname; exit 5"]}))
        token = token_file.read_text().strip()
        submit_env = {**launch_env, "RAY_AUTH_TOKEN": token}
        done = rlx(
            tmp_path,
            submit_env,
            "launch",
            str(job),
            "-b",
            "ray",
            "--address",
            f"http://127.0.0.1:{port}",
            timeout=180,
        )
        assert done.returncode == 5, done.stderr + done.stdout
        assert "node1" in done.stdout
    finally:
        forward.terminate()
        forward.wait(30)

    down = rlx(tmp_path, launch_env, "down", "kept")
    assert down.returncode == 0, down.stderr
    assert wait_state(tmp_path, launch_env, "kept", {"CANCELLED", "FAILED"}, 120) == "CANCELLED"
    # A hang bound: under a loaded suite the head's gcs_server took just over 60 s to exit.
    deadline = time.monotonic() + 180
    while job_processes(slurm_cluster):
        assert time.monotonic() < deadline, job_processes(slurm_cluster)
        time.sleep(1)


# About 7 minutes quiet; its waits end on progress stopping (JobWatch), so this is only the
# last guard against a hang they miss, not a budget that load should meet.
@pytest.mark.timeout(2400)
def test_requeue_resumes_after_a_lost_worker_and_the_warning(slurm_cluster, launch_env, tmp_path):
    """slurm.requeue: a worker killed mid-run fails the cluster (75) and the job requeues;
    the next attempt resumes from the newest checkpoint; Slurm's warning (USR1) makes the
    trainer save and the job requeue again; the last attempt finishes. One log folder per
    attempt."""
    # Enough steps that each attempt is still training when it is interrupted (a step of
    # the quickstart takes 1.5-3 s on these hosts with its save, and each interruption comes
    # within seconds of the attempt's first step: the first after step 2, the second a step
    # or two after the resume, so by step 6 at the latest). The last attempt trains the rest:
    # each step more costs it.
    steps = 12
    path = quickstart(tmp_path, "requeue", steps=steps)
    recipe = yaml.safe_load(path.read_text())
    recipe["slurm"] = {"requeue": {"retries": 2, "signal_lead": 60}}
    recipe["trainer"]["checkpoint"]["every"] = 2
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    started = time.monotonic()
    out = rlx(tmp_path, launch_env, "launch", str(path), "--backend", "slurm")
    assert out.returncode == 0, out.stderr
    job_id = out.stderr.split("(", 1)[1].split(")", 1)[0]
    logs = tmp_path / "rlx-logs"
    ckpts = tmp_path / "checkpoints" / job_id
    watch = JobWatch(job_id, launch_env, (logs, ckpts))

    # Attempt 1: once step 2 is saved, worker 1's raylet dies: exit 75, requeue.
    watch.wait(lambda: (ckpts / "step-000002" / "COMPLETE").exists(), "the step-2 checkpoint")
    worker = slurm_cluster.hosts[1]
    for proc in worker.processes():
        if proc.cmdline.split(" ", 1)[0].endswith("raylet"):
            os.kill(proc.pid, 9)
    second = logs / f"requeue-{job_id}-attempt1"
    start_requeued_now(watch, lambda: (logs / f"requeue-{job_id}").exists())

    # The trainer may take a step or two more before the lost node is noticed: attempt 2
    # resumes from whichever checkpoint was newest, then trains.
    def training_again() -> bool:
        return "\nstep " in _read(second / "head.log").partition("resumed from")[2]

    watch.wait(training_again, "attempt 2 training")
    print(
        f"\n[slurm-requeue] lost worker -> requeued -> training: {time.monotonic() - started:.0f} s"
    )
    driver = _read(logs / f"requeue-{job_id}" / "driver.log")
    assert "ended with exit code 75; requeueing (retry 1 of 2)" in driver, driver
    head2 = _read(second / "head.log")
    first_resume = re.search(r"resumed from \S+ \(step (\d+)\)", head2)
    assert first_resume and int(first_resume.group(1)) % 2 == 0, head2  # a cadence save
    assert int(first_resume.group(1)) >= 2, head2

    # Attempt 2: the warning signal, as Slurm sends it signal_lead seconds before the end.
    subprocess.run(
        ["scancel", "--batch", "--signal=USR1", job_id], env=launch_env, check=True, timeout=30
    )
    third = logs / f"requeue-{job_id}-attempt2"
    start_requeued_now(watch, lambda: True)
    finished = f"done: {steps} of {steps} steps"
    watch.wait(lambda: finished in _read(third / "head.log"), "attempt 3 to finish")
    head2 = _read(second / "head.log")
    saved = sorted(p.name for p in ckpts.glob("step-*") if (p / "COMPLETE").exists())
    head3 = _read(third / "head.log")
    resumed = head3.split("resumed from", 1)[1].split("\n", 1)[0]
    assert "received SIGUSR1" in head2, head2
    # It resumed from the newest checkpoint the second attempt left (saved on the signal when
    # that step was not on the cadence).
    found = re.search(r"\(step (\d+)\)", resumed)
    assert found, resumed
    step = int(found.group(1))
    assert step > int(first_resume.group(1)), (resumed, saved, head2[-3000:])
    # ... the one the second attempt wrote last (retention has rotated it out since).
    written = re.findall(r"^checkpoint \S+/step-(\d+) ", head2, re.M)
    assert written and int(written[-1]) == step, (written, resumed)
    assert saved[-1] == f"step-{steps:06d}"
    # The job's end as Slurm sees it (its teardown's length is the machine's); then rlx's
    # reading of it, which follows within a poll or two.
    watch.wait(lambda: watch.state() in TERMINAL_STATES | {""}, "the job to end")
    assert wait_state(tmp_path, launch_env, "requeue", {"SUCCEEDED", "FAILED"}, 60) == "SUCCEEDED"
    # The finished run as rlx shows it: progress from the shared run folder, every step
    # logged once across the attempts (step 0: the quickstart's validation before training),
    # the worker told the head's exit code, nothing left running.
    status = rlx(tmp_path, launch_env, "status", "requeue").stdout
    assert f"step {steps} of {steps}" in status and "elapsed" in status, status
    runs = list((tmp_path / "runs").glob("*/metrics.jsonl"))
    records = [json.loads(line) for line in runs[0].read_text().splitlines()] if runs else []
    assert [r["step"] for r in records] == list(range(steps + 1)), records
    worker_log = rlx(tmp_path, launch_env, "logs", "requeue", "--node", "1").stdout
    assert "the head finished with exit code 0" in worker_log, worker_log
    assert job_processes(slurm_cluster) == []
    print(f"[slurm-requeue] three attempts, finished after {time.monotonic() - started:.0f} s")
    attempts = [p.name for p in logs.iterdir() if p.is_dir() and p.name != ".rlx-wheels"]
    assert sorted(attempts) == [
        f"requeue-{job_id}",
        f"requeue-{job_id}-attempt1",
        f"requeue-{job_id}-attempt2",
    ]


def start_requeued_now(watch: JobWatch, ready: Callable[[], bool]) -> None:
    """Slurm holds a requeued job back for two minutes (its BeginTime); once the job is
    pending again and its nodes are idle, let it start now so the test does not wait. The
    update is repeated until the job leaves PENDING: one issued while the requeue is still
    settling can be refused. Waits as long as the previous attempt's teardown moves."""
    updated = False

    def started() -> bool:
        nonlocal updated
        state = watch.state()
        if updated and state not in ("PENDING", "REQUEUED", "REQUEUE_HOLD", "COMPLETING"):
            return True
        if state == "PENDING" and ready() and all(n == "idle" for n in watch.node_states()):
            # slurmd refuses a job whose credential it revoked in the same second (the
            # previous attempt's): "Job credential revoked". Start it a second later.
            time.sleep(1.5)
            subprocess.run(
                ["scontrol", "update", f"JobId={watch.job_id}", "StartTime=now"],
                env=watch.env,
                check=False,
            )
            updated = True
            time.sleep(1)
        return False

    watch.wait(started, f"job {watch.job_id} to be requeued and start")


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def test_node_groups_run_as_a_heterogeneous_job(slurm_cluster, launch_env, tmp_path):
    """resources.groups on the real Slurm: a heterogeneous job (1 training node, 2 rollout
    nodes) runs to its end; one Ray cluster spans both components, every node labelled with
    its group as Ray's node table shows, the training rank on the training node and one
    engine on each rollout node, never on the training node."""
    path = quickstart(tmp_path, "groups", steps=2)
    recipe = yaml.safe_load(path.read_text())
    recipe["resources"] = {"groups": {"train": {"nodes": 1}, "rollout": {"nodes": 2}}}
    trainer = recipe["trainer"]
    trainer["layout"] = "split"  # engines: one per rollout node (CPU-only groups)
    trainer["batch"]["prompts_per_step"] = 2
    trainer["validation"] = None
    trainer["checkpoint"] = {}
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    argv = [sys.executable, "-m", "rlx", "launch", str(path), "--backend", "slurm"]
    run = launch_and_wait(slurm_cluster, argv, tmp_path, launch_env, "groups", timeout=600)
    print(f"\n[slurm-groups] launch to the job's end: {run.seconds:.1f} s")
    assert run.job.state == "COMPLETED" and run.job.exit_code == 0, run.report()
    train_ip, *rollout_ips = [host.ip for host in slurm_cluster.hosts]
    head = run.logs["head.log"]
    assert "all 3 nodes joined" in head, run.report()
    # Ray's own node table: each node carries its group's label.
    assert (
        f"node groups (Ray label rlx-node-group): train: {train_ip}; "
        f"rollout: {', '.join(rollout_ips)}" in head
    ), head
    ranks = re.search(r"training workers: (.*)", head)
    engines = re.search(r"rollout workers: (.*)", head)
    assert ranks and engines, head
    assert ranks.group(1) == f"rank 0 on {train_ip}"
    placed = sorted(part.split(" on ")[1] for part in engines.group(1).split(", "))
    assert placed == sorted(rollout_ips), engines.group(1)
