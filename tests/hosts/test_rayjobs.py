"""Ray jobs submitted to a kept cluster, for real: three emulated hosts run the SkyPilot
rendering of a recipe launched with --keep; `rlx launch -b ray` reaches the head's
dashboard only through a tunnel (rlx's relay, run on the head the way ssh -L runs its
channel), with the job's token; status, logs, down and exit codes come from Ray's Jobs API.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from rlx.launchers import tunnel
from rlx.launchers.keep import kept_recipe
from tests.support.cli import run_rlx
from tests.support.hosts.probejob import assert_nothing_left, poll, probe_recipe
from tests.support.hosts.rendered import REPO, RenderedJob

pytest.importorskip("ray")
pytest.importorskip("sky")
pytestmark = [pytest.mark.hosts, pytest.mark.timeout(600)]

DASHBOARD = 8265


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Kept:
    """A kept cluster on three hosts, its token and the local end of the tunnel."""

    def __init__(self, hosts, workdir: Path) -> None:
        self.hosts = hosts
        self.workdir = workdir
        self.token = secrets.token_hex(32)
        recipe = kept_recipe(probe_recipe(workdir / "probe").model_copy(update={"name": "kept"}))
        self.job = RenderedJob.from_recipe("sky", recipe, hosts, workdir)
        self.runs = self.job.start_all({"RLX_RAY_TOKEN": self.token})
        self.port = free_port()
        self.server = tunnel.listen(self.port)
        self.stop = threading.Event()
        argv = [*hosts[0].enter_argv(), *tunnel.relay_argv(DASHBOARD, sys.executable)]
        self.thread = threading.Thread(
            target=tunnel.serve, args=(self.server, argv, self.stop), daemon=True
        )
        self.thread.start()

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def rlx(
        self, *args: str, token: str | None = "", timeout: float = 180
    ) -> subprocess.CompletedProcess:
        token = self.token if token == "" else (token or "")
        return run_rlx(list(args), self.workdir, timeout=timeout, RAY_AUTH_TOKEN=token)

    def close(self) -> None:
        self.stop.set()
        for run in self.runs:
            if run.proc.poll() is None:
                run.proc.send_signal(signal.SIGTERM)
        for run in self.runs:
            run.wait(60)


@pytest.fixture
def kept(emulated_hosts, tmp_path: Path) -> Iterator[Kept]:
    cluster = Kept(emulated_hosts, tmp_path)
    try:
        started = time.monotonic()
        poll(lambda: "rlx: cluster kept" in cluster.runs[0].output(), 180, "the kept cluster")
        print(f"\n[rayjobs] kept cluster formed in {time.monotonic() - started:.1f} s")
        yield cluster
    finally:
        cluster.close()


def write_job(workdir: Path, name: str, command: str, auth: str = "token") -> Path:
    path = workdir / f"{name}.yaml"
    path.write_text(
        yaml.safe_dump({"name": name, "command": [command], "ray": {"auth": auth}}),
        encoding="utf-8",
    )
    return path


NODES_SEEN = (
    f"{sys.executable} -c 'import ray; ray.init(); "
    'print("alive nodes:", sum(n["Alive"] for n in ray.nodes()))\''
)


def test_ray_jobs_on_a_kept_cluster(kept: Kept) -> None:
    w = kept.workdir
    head = kept.hosts[0]
    assert "cluster formed: 3/3 nodes online, 0/0 GPUs" in kept.runs[0].output()
    # The dashboard listens on the head's loopback only; a peer cannot reach it.
    listening = head.run(["ss", "-ltnH", f"sport = :{DASHBOARD}"], timeout=30).stdout
    assert listening.strip() and all(
        line.split()[3].startswith("127.0.0.1:") for line in listening.strip().splitlines()
    ), listening
    peer = kept.hosts[1].run(
        [
            sys.executable,
            "-c",
            f"import socket; socket.create_connection(('{head.ip}', {DASHBOARD}), 3)",
        ],
        timeout=30,
    )
    assert peer.returncode != 0 and "refused" in peer.stderr.lower(), peer

    # A job that reaches every node, followed to its end: exit 0.
    t0 = time.monotonic()
    done = kept.rlx(
        "launch", str(write_job(w, "seen", NODES_SEEN)), "-b", "ray", "--address", kept.address
    )
    print(f"\n[rayjobs] submit + run + follow (ray.init, 3 nodes): {time.monotonic() - t0:.1f} s")
    assert done.returncode == 0, done.stderr + done.stdout
    assert "alive nodes: 3" in done.stdout, done.stdout
    assert "succeeded" in done.stderr

    # The driver's own exit code, through launch, logs and status.
    done = kept.rlx(
        "launch",
        str(write_job(w, "three", "echo before-exit; exit 3")),
        "-b",
        "ray",
        "--address",
        kept.address,
    )
    assert done.returncode == 3, done.stderr + done.stdout
    assert "before-exit" in done.stdout
    logs = kept.rlx("logs", "three")
    assert logs.returncode == 3 and "before-exit" in logs.stdout, logs
    status = kept.rlx("status", "three")
    assert "FAILED" in status.stdout and "exit code 3" in status.stdout, status.stdout

    # Stopped: detached, followed from another process, stopped with rlx down.
    done = kept.rlx(
        "launch",
        str(write_job(w, "sleeper", "echo sleeping; sleep 300")),
        "-b",
        "ray",
        "--address",
        kept.address,
        "--detach",
    )
    assert done.returncode == 0, done.stderr
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_AUTH_TOKEN": kept.token, "RAY_ADDRESS": ""}
    follower = subprocess.Popen(
        [sys.executable, "-m", "rlx", "logs", "sleeper", "-f"],
        cwd=w,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(5)
    down = kept.rlx("down", "sleeper")
    assert down.returncode == 0, down.stderr
    out, err = follower.communicate(timeout=120)
    assert follower.returncode == 143, (out, err)
    assert "sleeping" in out
    assert "CANCELLED" in kept.rlx("status", "sleeper").stdout

    # Without the token, or with another one, the dashboard refuses the job.
    refused = kept.rlx(
        "launch",
        str(write_job(w, "anon", "true", auth="none")),
        "-b",
        "ray",
        "--address",
        kept.address,
        token=None,
    )
    assert refused.returncode == 1 and "requires a token" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr
    wrong = kept.rlx(
        "launch",
        str(write_job(w, "wrong", "true")),
        "-b",
        "ray",
        "--address",
        kept.address,
        token="0" * 64,
    )
    assert wrong.returncode == 1 and "refused the token" in wrong.stderr, wrong.stderr

    # The kept cluster ends when its run blocks are stopped, leaving nothing behind.
    kept.close()
    assert_nothing_left(kept.hosts)


FAILING_TASK = (
    f"{sys.executable} -c 'import ray; ray.init()\n"
    "@ray.remote(max_retries=0)\n"
    "def boom():\n"
    '    raise ValueError("boom")\n'
    "ray.get(boom.remote())'"
)


def test_post_mortem_debugger_listens_on_a_failing_task(emulated_hosts, tmp_path: Path) -> None:
    """ray.debug: post-mortem on every node; a failing remote task waits for a debugger and
    the head's log shows where it listens."""
    spec = importlib.util.find_spec("debugpy")  # in rlx[node] and rlx[dev]
    assert spec is not None and spec.origin is not None, "debugpy is not installed"
    hosts = emulated_hosts
    recipe = probe_recipe(tmp_path / "probe").model_copy(
        update={"name": "debug", "command": [FAILING_TASK]}
    )
    recipe = recipe.model_copy(
        update={"ray": recipe.ray.model_copy(update={"debug": "post-mortem"})}
    )
    job = RenderedJob.from_recipe("sky", recipe, hosts, tmp_path)
    token = secrets.token_hex(32)
    # debugpy wherever this interpreter finds it (a separate folder is fine).
    pythonpath = f"{REPO}:{Path(spec.origin).parent.parent}"
    runs = [
        job.start(rank, {"RLX_RAY_TOKEN": token}, extra_env={"PYTHONPATH": pythonpath})
        for rank in range(len(hosts))
    ]
    try:
        started = time.monotonic()
        poll(lambda: "Ray debugger is listening on" in runs[0].output(), 240, "the debugger line")
        print(f"\n[rayjobs] post-mortem debugger line after {time.monotonic() - started:.1f} s")
        line = next(ln for ln in runs[0].output().splitlines() if "debugger is listening" in ln)
        assert any(h.ip in line for h in hosts), line
        # Every node's Ray runs with the switch, so any worker would do the same.
        for host in hosts:
            raylet = next(
                p for p in host.processes() if p.cmdline.split(" ", 1)[0].endswith("raylet")
            )
            environ = Path(f"/proc/{raylet.pid}/environ").read_bytes().split(b"\0")
            assert b"RAY_DEBUG_POST_MORTEM=1" in environ, host.name
    finally:
        for run in runs:
            if run.proc.poll() is None:
                run.proc.send_signal(signal.SIGTERM)
        for run in runs:
            run.wait(60)
    assert_nothing_left(hosts)
