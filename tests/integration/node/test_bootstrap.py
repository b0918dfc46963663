"""`rlx node` on one machine with the real Ray: start, run, exit with the command's code,
and leave nothing running. (Several hosts: tests/hosts/test_multinode.py.)"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from rlx import procfs
from rlx.node import raynode
from rlx.node.env import primary_ip

pytest.importorskip("ray")
pytestmark = pytest.mark.timeout(300)

PORT = 6479  # away from a developer's own Ray on 6379


def recipe_file(tmp_path: Path, command: list[str], **ray: object) -> Path:
    settings = {
        "port": PORT,
        "dashboard_port": 8365,
        "client_server_port": 10201,
        "join_timeout": 60,
        **ray,
    }
    path = tmp_path / "probe.yaml"
    path.write_text(yaml.safe_dump({"name": "probe", "command": command, "ray": settings}))
    return path


def rlx_node(
    recipe: Path, env: dict[str, str], backend: str = "local", timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rlx", "node", "--backend", backend, "--recipe", str(recipe)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_nothing_left(ip: str) -> None:
    assert raynode.own_ray_pids(f"{ip}:{PORT}", PORT) == []


def test_runs_command_and_exits_with_its_code(tmp_path, path_env):
    probe = tmp_path / "probe.out"
    command = [
        f'echo "$RAY_ADDRESS $RLX_NUM_NODES $RLX_BACKEND" > {probe}',
        "python -c 'import ray; ray.init(); print(int(ray.cluster_resources()[\"CPU\"]))'"
        f" >> {probe}",
        "exit 3",
    ]
    result = rlx_node(recipe_file(tmp_path, command, auth="none"), path_env)
    assert result.returncode == 3, result.stderr
    ip = primary_ip()
    address, nodes, backend, *rest = probe.read_text().split()
    assert (address, nodes, backend) == (f"{ip}:{PORT}", "1", "local")
    assert int(rest[-1]) >= 1  # the command reached the cluster it was given
    assert "all 1 nodes joined" in result.stderr
    assert_nothing_left(ip)


def test_token_auth_and_success(tmp_path, path_env):
    command = ["python -c 'import ray; ray.init(); print(ray.is_initialized())'"]
    env = {**path_env, "RLX_RAY_TOKEN": "0123456789abcdef" * 4}
    result = rlx_node(recipe_file(tmp_path, command), env)
    assert result.returncode == 0, result.stderr
    assert "True" in result.stdout
    assert_nothing_left(primary_ip())


def test_auth_none_ignores_a_stale_token_file(tmp_path, path_env):
    # Any earlier local `ray.init()` leaves ~/.ray/auth_token; with the auth mode unset,
    # `ray start` would then turn token auth on by itself and lock our own clients out.
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("f" * 64)
    command = ["python -c 'import ray; ray.init(); print(ray.is_initialized())'"]
    env = {**path_env, "HOME": str(home)}
    result = rlx_node(recipe_file(tmp_path, command, auth="none"), env)
    assert result.returncode == 0, result.stderr
    assert "True" in result.stdout
    assert_nothing_left(primary_ip())


def test_a_taken_head_port_is_one_clear_error(tmp_path, path_env):
    ip = primary_ip()
    with socket.create_server((ip, PORT)):  # something else holds the GCS port
        result = rlx_node(recipe_file(tmp_path, ["true"], auth="none"), path_env, timeout=120)
    assert result.returncode == 1, result.stderr
    assert f"ray.port ({PORT}) already in use on this node" in result.stderr
    assert "Traceback" not in result.stderr
    assert_nothing_left(ip)


def test_missing_token_is_one_clear_line(tmp_path, path_env):
    env = {k: v for k, v in path_env.items() if k != "RLX_RAY_TOKEN"}
    result = rlx_node(recipe_file(tmp_path, ["true"]), env, timeout=60)
    assert result.returncode == 1
    assert "RLX_RAY_TOKEN is not set" in result.stderr
    assert "Traceback" not in result.stderr


def test_missing_node_is_named_and_command_never_runs(tmp_path, path_env):
    ip = primary_ip()
    marker = tmp_path / "started"
    env = {
        **path_env,
        "SKYPILOT_NODE_RANK": "0",
        "SKYPILOT_NODE_IPS": f"{ip}\n10.255.255.7",
        "SKYPILOT_NUM_NODES": "2",
        "SKYPILOT_NUM_GPUS_PER_NODE": "0",
    }
    result = rlx_node(
        # 30 s: the head's own Ray can take over 10 s to start on a busy 2-core machine
        recipe_file(tmp_path, [f"touch {marker}"], auth="none", join_timeout=30),
        env,
        backend="sky",
    )
    assert result.returncode == 75, result.stderr
    assert "missing node 1 (10.255.255.7)" in result.stderr
    assert not marker.exists()
    assert_nothing_left(ip)


def test_daemons_left_by_a_child_stay_in_the_bootstraps_tree(tmp_path):
    """`ray start` daemonizes and exits; as a subreaper (on Slurm) the bootstrap becomes the
    daemon's parent, so Slurm's SIGKILL of the step's process tree reaches it (no GCS
    outlives a cancelled job). Without adopt_orphans the daemon's parent is init."""
    script = tmp_path / "parent.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, subprocess, sys, time
            from rlx.node.bootstrap import adopt_orphans
            adopted = sys.argv[1] == "adopt" and adopt_orphans()
            # a child that starts a daemon and exits at once, like `ray start`
            starter = subprocess.run(
                [sys.executable, "-c",
                 "import subprocess, sys; "
                 "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
                 "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
                 "print(p.pid)"],
                capture_output=True, text=True, check=True,
            )
            daemon = int(starter.stdout)
            time.sleep(0.5)
            with open(f"/proc/{daemon}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            subprocess.run(["kill", str(daemon)])
            print(adopted, parent == os.getpid())
            """
        )
    )
    for mode in ("adopt", "plain"):
        out = subprocess.run(
            [sys.executable, str(script), mode], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        adopted, ours = out.stdout.split()
        assert (adopted, ours) == (("True", "True") if mode == "adopt" else ("False", "False"))


def test_sigterm_to_every_process_lets_the_command_save_with_ray_up_and_exit_75(tmp_path, path_env):
    """A spot reclaim: SIGTERM to every process of the node at once, Ray's daemons too. They
    stay up while the head command takes a moment to save (its GCS still answers), then go;
    the node's exit code is the command's (75), not 128 + 15, well inside GCP's 30 s."""
    ip = primary_ip()
    saved = tmp_path / "saved"
    started = tmp_path / "started"
    command = [
        f"trap 'sleep 2; (exec 3<>/dev/tcp/{ip}/{PORT}) && touch {saved}; exit 75' TERM",
        f"touch {started}",
        "while true; do sleep 0.2; done",
    ]
    recipe = recipe_file(tmp_path, command, auth="none")
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlx", "node", "--backend", "local", "--recipe", str(recipe)],
        env=path_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        while not started.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        everyone = {proc.pid, *raynode.own_ray_pids(f"{ip}:{PORT}", PORT)}
        parents = procfs.parents()
        while grown := {pid for pid, ppid in parents.items() if ppid in everyone} - everyone:
            everyone |= grown
        signalled = time.monotonic()
        for pid in everyone:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 75, err
    assert saved.exists(), err  # the GCS still answered 2 s after the signal
    assert "received SIGTERM: the job saves and stops" in err
    assert took < 25, err
    assert_nothing_left(ip)
