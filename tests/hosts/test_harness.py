"""The emulated-host harness and the Slurm cluster on it do what multi-node tests rely on."""

from __future__ import annotations

import json
import os
import random
import signal
import string
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.support.hosts import (
    Host,
    HostProcess,
    HostProcessInfo,
    Hosts,
    HostsError,
    SlurmCluster,
    backend_env,
)
from tests.support.hosts.fixtures import HostsFactory
from tests.support.hosts.procs import start_time, wait_until
from tests.support.hosts.slots import NETNS_DIR, sweep_stale

pytestmark = pytest.mark.hosts

PY = sys.executable

# Listens on the host's own address, says so, then answers each client with its hostname.
ECHO_SERVER = textwrap.dedent(
    """
    import socket, sys
    server = socket.create_server((sys.argv[1], int(sys.argv[2])))
    print("listening", flush=True)
    for _ in range(int(sys.argv[3])):
        conn, _ = server.accept()
        conn.sendall(socket.gethostname().encode())
        conn.close()
    """
)
ECHO_CLIENT = textwrap.dedent(
    """
    import socket, sys
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10) as conn:
        print(conn.recv(100).decode())
    """
)


def _links() -> set[str]:
    done = subprocess.run(
        ["ip", "-json", "link", "show"], check=True, capture_output=True, text=True
    )
    return {link["ifname"] for link in json.loads(done.stdout)}


def _alive(pid: int, started: str) -> bool:
    """The process that had `started` as start time still runs (a zombie does not count)."""
    if start_time(pid) != started:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _commands(host: Host) -> list[str]:
    return [p.cmdline for p in host.processes()]


def _start_echo_server(host: Host, port: int, clients: int) -> HostProcess:
    server = host.popen(
        [PY, "-c", ECHO_SERVER, host.ip, str(port), str(clients)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdout.readline().strip() == "listening"
    return server


def test_hosts_have_distinct_names_and_addresses(emulated_hosts: Hosts) -> None:
    seen = []
    for host in emulated_hosts:
        done = host.run("hostname; ip -4 -o addr show dev eth0", check=True, timeout=30)
        name, addr_line = done.stdout.splitlines()
        assert name == host.name
        assert f"inet {host.ip}/24" in addr_line
        seen.append((name, host.ip))
    assert seen == [("node1", emulated_hosts.ips[0]), ("node2", emulated_hosts.ips[1]),
                    ("node3", emulated_hosts.ips[2])]  # fmt: skip
    assert len(set(emulated_hosts.ips)) == 3
    # And none of them is this machine.
    assert os.uname().nodename not in emulated_hosts.names


def test_hosts_reach_each_other_by_address_and_name(emulated_hosts: Hosts) -> None:
    node1, node2, node3 = emulated_hosts
    server = _start_echo_server(node2, 41000, clients=2)
    by_ip = node1.run([PY, "-c", ECHO_CLIENT, node2.ip, "41000"], timeout=30)
    by_name = node3.run([PY, "-c", ECHO_CLIENT, "node2", "41000"], timeout=30)
    assert server.wait(timeout=30) == 0
    assert (by_ip.returncode, by_ip.stdout.strip()) == (0, "node2"), by_ip.stderr
    assert (by_name.returncode, by_name.stdout.strip()) == (0, "node2"), by_name.stderr


def test_hosts_reach_this_machine_by_its_hostname(emulated_hosts: Hosts) -> None:
    # This machine is the cluster's login/controller node, at the bridge address.
    done = emulated_hosts[2].run(["getent", "ahostsv4", os.uname().nodename], timeout=30)
    assert done.returncode == 0
    assert done.stdout.split()[0] == emulated_hosts.bridge_ip


def test_each_host_has_its_own_tmp_ray_and_shm(emulated_hosts: Hosts, tmp_path: Path) -> None:
    node1, node2, _ = emulated_hosts
    node1.run(
        f"echo one > /tmp/ray/marker && echo one > /dev/shm/marker && echo shared > {tmp_path}/f",
        check=True,
        timeout=30,
    )
    assert node1.run("cat /tmp/ray/marker /dev/shm/marker", timeout=30).stdout == "one\none\n"
    on_node2 = node2.run("ls -A /tmp/ray /dev/shm", timeout=30)
    assert "marker" not in on_node2.stdout
    assert not Path("/tmp/ray/marker").exists()  # nor on this machine
    # Everything else is shared, like an NFS home.
    assert node2.run(f"cat {tmp_path}/f", timeout=30).stdout == "shared\n"


def test_each_host_has_its_own_process_table(emulated_hosts: Hosts) -> None:
    node1, node2, _ = emulated_hosts
    sleeper = node1.popen(["sleep", "300"])
    try:
        assert sleeper.inner_pid is not None

        def sleeping() -> list[HostProcessInfo]:
            # Until it execs, the command shows as the nsenter it was forked from.
            return [p for p in node1.processes() if p.cmdline == "sleep 300"]

        wait_until(lambda: bool(sleeping()), 10, "sleep to start on node1")
        on_node1 = sleeping()
        assert [p.pid for p in on_node1] == [sleeper.inner_pid]
        assert on_node1[0].host_pid < 100  # numbered inside the host, after its PID 1
        assert not [p for p in node2.processes() if "sleep" in p.cmdline]
        assert "sleep" in node1.run("ps -e -o comm=", timeout=30).stdout
        assert "sleep" not in node2.run("ps -e -o comm=", timeout=30).stdout
        assert node2.run("ps -p 1 -o comm=", timeout=30).stdout.strip() == "python"
    finally:
        sleeper.kill()
        sleeper.wait()


def test_terminate_reaches_the_command_on_the_host(emulated_hosts: Hosts) -> None:
    proc = emulated_hosts[0].popen(["sleep", "300"])
    inner = proc.inner_pid
    proc.terminate()
    assert proc.wait(timeout=30) == -signal.SIGTERM
    assert inner is not None and start_time(inner) is None
    assert emulated_hosts[0].processes() == []


def test_run_timeout_kills_the_command_and_its_children(emulated_hosts: Hosts) -> None:
    host = emulated_hosts[1]
    with pytest.raises(subprocess.TimeoutExpired):
        host.run("sleep 300 & sleep 301; echo never", timeout=1)
    wait_until(lambda: host.processes() == [], 10, "the timed-out commands to go")


def test_kill_all_empties_one_host_only(emulated_hosts: Hosts) -> None:
    node1, node2, _ = emulated_hosts
    for host in (node1, node2):
        host.run("setsid sleep 300 > /dev/null 2>&1 & disown", check=True, timeout=30)
        # The orphan may not have exec'd yet when its shell returns.
        wait_until(lambda h=host: _commands(h) == ["sleep 300"], 10, f"sleep on {host.name}")
    node1.kill_all()
    assert node1.processes() == []
    assert _commands(node2) == ["sleep 300"]
    assert node1.run("echo still up", timeout=30).stdout == "still up\n"


def test_close_leaves_nothing_behind(hosts_factory: HostsFactory) -> None:
    hosts = hosts_factory(2)
    for host in hosts:
        host.run("setsid sleep 300 > /dev/null 2>&1 &", check=True, timeout=30)
    running = [(p.pid, start_time(p.pid)) for host in hosts for p in host.processes()]
    assert len(running) == 2
    netns = [host.netns for host in hosts]
    hosts.close()
    assert not [pid for pid, started in running if _alive(pid, started)]
    assert not [name for name in netns if (NETNS_DIR / name).exists()]
    assert hosts.bridge not in _links()
    assert not hosts.state_dir.exists()
    hosts.close()  # idempotent


CRASHING_RUN = textwrap.dedent(
    """
    import os, signal, subprocess, sys
    from tests.support.hosts import Hosts
    hosts = Hosts.create(2, prefix=sys.argv[1])
    # A daemon of the root namespace that outlives us unless the sweep kills it.
    quiet = subprocess.DEVNULL  # it must not hold our parent's pipes open
    daemon = subprocess.Popen(["sleep", "300"], stdout=quiet, stderr=quiet, start_new_session=True)
    hosts.register_daemon(daemon.pid)
    print(hosts.state_dir, daemon.pid, hosts.bridge, *[h.netns for h in hosts], flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_sweep_removes_what_a_crashed_run_left(
    hosts_factory: HostsFactory, request: pytest.FixtureRequest
) -> None:
    # A prefix of this test's own, so that a concurrent session cannot muddle the picture.
    prefix = "rlx" + "".join(random.choices(string.ascii_lowercase, k=2))
    request.addfinalizer(lambda: sweep_stale(prefix))
    repo = REPO
    crashed = subprocess.run(
        [PY, "-c", CRASHING_RUN, prefix],
        check=False,
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    state_dir, daemon_pid, *links = crashed.stdout.split()
    netns = links[1:]
    daemon_started = start_time(int(daemon_pid))
    # The crash left its namespaces, bridge, state and daemon behind ...
    assert all((NETNS_DIR / name).exists() for name in netns)
    assert links[0] in _links()
    assert Path(state_dir).is_dir()
    assert daemon_started is not None and _alive(int(daemon_pid), daemon_started)
    # ... and the next run with that prefix sweeps them before making its own.
    fresh = hosts_factory(1, prefix=prefix)
    assert not _alive(int(daemon_pid), daemon_started)
    if fresh.state_dir == Path(state_dir):
        # It took the freed slot: its one host reuses the first name, the second is gone.
        assert [name for name in netns if (NETNS_DIR / name).exists()] == [fresh[0].netns]
    else:
        assert not [name for name in netns if (NETNS_DIR / name).exists()]
        assert links[0] not in _links()
        assert not Path(state_dir).exists()
    assert fresh[0].run("hostname", timeout=30).stdout == "node1\n"


def test_backend_env_matches_each_backend_contract(emulated_hosts: Hosts) -> None:
    ips = emulated_hosts.ips
    sky = backend_env("sky", emulated_hosts, 1, gpus_per_node=2, task_id="t-1")
    assert sky == {
        "SKYPILOT_NODE_RANK": "1",
        "SKYPILOT_NODE_IPS": f"{ips[0]}\n{ips[1]}\n{ips[2]}",
        "SKYPILOT_NUM_NODES": "3",
        "SKYPILOT_NUM_GPUS_PER_NODE": "2",
        "SKYPILOT_TASK_ID": "t-1",
    }
    dstack = backend_env("dstack", emulated_hosts, 2, gpus_per_node=4, task_id="run-a")
    assert dstack == {
        "DSTACK_NODE_RANK": "2",
        "DSTACK_MASTER_NODE_IP": ips[0],
        "DSTACK_NODES_IPS": f"{ips[0]}\n{ips[1]}\n{ips[2]}",
        "DSTACK_NODES_NUM": "3",
        "DSTACK_GPUS_PER_NODE": "4",
        "DSTACK_GPUS_NUM": "12",
        "DSTACK_RUN_NAME": "run-a",
    }
    # What a run block sees on the host.
    shown = emulated_hosts[2].run(
        'echo "$DSTACK_NODE_RANK $(echo "$DSTACK_NODES_IPS" | head -1)"', env=dstack, timeout=30
    )
    assert shown.stdout == f"2 {ips[0]}\n"
    with pytest.raises(ValueError, match="valid: dstack, sky"):
        backend_env("k8s", emulated_hosts, 0)
    with pytest.raises(ValueError, match="rank 3"):
        backend_env("sky", emulated_hosts, 3)


# Slurm --------------------------------------------------------------------------------

# Prints, from every task, the node it ran on and the address it reaches the controller from.
WHERE_AM_I = textwrap.dedent(
    """\
    #!/bin/bash
    set -euo pipefail
    echo "batch $(hostname) $SLURM_JOB_NODELIST"
    srun bash -c '{py} -c "import os, socket
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.connect((\\"{controller}\\", 9))
    print(\\"task\\", os.environ[\\"SLURM_NODEID\\"], socket.gethostname(), s.getsockname()[0])"'
    """
)


@pytest.mark.slurm
@pytest.mark.timeout(180)
def test_sbatch_runs_srun_on_three_distinct_nodes(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    hosts = slurm_cluster.hosts
    script = tmp_path / "where.sh"
    script.write_text(WHERE_AM_I.format(py=PY, controller=hosts.bridge_ip))
    out = tmp_path / "out.txt"
    job_id, done = slurm_cluster.sbatch(
        ["-N", "3", f"--output={out}", str(script)], wait=True, cwd=tmp_path
    )
    log = out.read_text()
    assert done.returncode == 0, f"{done.stderr}\n{log}"
    tasks = sorted(line.split()[1:] for line in log.splitlines() if line.startswith("task "))
    assert tasks == [[str(rank), host.name, host.ip] for rank, host in enumerate(hosts)], log
    assert log.startswith("batch node1 node[1-3]\n")
    job = slurm_cluster.job(job_id)
    assert (job.state, job.exit_code, job.nodes) == ("COMPLETED", 0, "node[1-3]")


@pytest.mark.slurm
@pytest.mark.timeout(180)
def test_failed_job_reports_its_exit_code(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    job_id, done = slurm_cluster.sbatch(
        ["-N", "2", f"--output={tmp_path}/out.txt", "--wrap", "srun true && exit 3"],
        wait=True,
        cwd=tmp_path,
    )
    assert done.returncode == 3
    job = slurm_cluster.job(job_id)
    assert (job.state, job.exit_code, job.signal) == ("FAILED", 3, 0)
    record = [
        line
        for line in (slurm_cluster.log_dir / "jobcomp.txt").read_text().splitlines()
        if line.startswith(f"JobId={job_id} ")
    ]
    assert len(record) == 1 and "JobState=FAILED" in record[0] and "ExitCode=3:0" in record[0]


@pytest.mark.slurm
@pytest.mark.timeout(180)
def test_scancel_stops_the_job_on_every_host(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    hosts = slurm_cluster.hosts
    job_id, _ = slurm_cluster.sbatch(
        ["-N", "3", f"--output={tmp_path}/out.txt", "--wrap", "srun sleep 1000"], cwd=tmp_path
    )

    def sleeping_everywhere() -> bool:
        return all(
            any(p.cmdline.endswith("sleep 1000") for p in host.processes()) for host in hosts
        )

    wait_until(sleeping_everywhere, 120, "the job's step to run on all three hosts")
    slurm_cluster.command(["scancel", str(job_id)])
    job = slurm_cluster.wait_job(job_id, timeout=60)
    assert job.state == "CANCELLED"

    def only_slurmd_left() -> bool:
        return all([p.cmdline.split()[0] for p in host.processes()] == ["slurmd"] for host in hosts)

    try:
        wait_until(only_slurmd_left, 60, "the job's processes to go")
    except HostsError:
        left = {host.name: [p.cmdline for p in host.processes()] for host in hosts}
        pytest.fail(f"processes left after scancel: {left}")
