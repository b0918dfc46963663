"""What a peer on the cluster's network can and cannot do to a running rlx job.

A rendered job runs on two emulated hosts with Ray token authentication (the default),
and a third host on the same network plays the peer: it cannot reach the dashboard, its
GCS calls and its `ray start` are refused without the job's token, and `ray job submit`
without the token is refused even on the head itself. The token is fresh per job and is
never written to a file.
"""

from __future__ import annotations

import re
import subprocess
import textwrap
from collections.abc import Sequence
from pathlib import Path

import pytest

from rlx.launchers.base import collect_secrets
from rlx.node.env import RAY_TOKEN_SECRET
from rlx.recipe import parse_recipe
from tests.support.hosts import Host, SlurmCluster
from tests.support.hosts.probejob import (
    Job,
    assert_nothing_left,
    kill_leftovers,
    ray_processes,
)
from tests.support.hosts.rendered import node_base_env

pytest.importorskip("ray")
pytestmark = [pytest.mark.hosts, pytest.mark.timeout(600)]

GCS_PORT = 6379
DASHBOARD_PORT = 8265
# A GCS call from outside the job: how many nodes the cluster has.
COUNT_NODES = textwrap.dedent(
    """
    import sys
    from ray._raylet import GcsClient
    client = GcsClient(address=sys.argv[1])
    print(len(client.get_all_node_info(timeout=5)))
    """
)
REFUSED = "Authentication token is missing or incorrect"
# An HTTP GET: the status and body, or "unreachable" and why.
HTTP_GET = textwrap.dedent(
    """
    import sys, urllib.error, urllib.request
    try:
        with urllib.request.urlopen(sys.argv[1], timeout=5) as reply:
            print(reply.status, reply.read().decode())
    except urllib.error.HTTPError as error:
        print(error.code, error.read().decode())
    except OSError as error:
        print("unreachable", error)
    """
)


def on_host(
    host: Host, workdir: Path, cmd: Sequence[str] | str, timeout: float = 120, **env: str
) -> subprocess.CompletedProcess[str]:
    """Run `cmd` on `host` as an outsider: no token unless given in `env`."""
    return host.run(cmd, env={**node_base_env(workdir), **env}, timeout=timeout)


def count_nodes(host: Host, workdir: Path, head: str, **env: str) -> subprocess.CompletedProcess:
    return on_host(host, workdir, ["python", "-c", COUNT_NODES, f"{head}:{GCS_PORT}"], **env)


def token_of(host: Host) -> str:
    """The Ray token the job's raylet on `host` runs with (read from its environment)."""
    raylets = ray_processes(host, "raylet")
    assert len(raylets) == 1, host.processes()
    environ = Path(f"/proc/{raylets[0]}/environ").read_bytes().split(b"\0")
    settings = dict(item.decode().split("=", 1) for item in environ if b"=" in item)
    assert settings.get("RAY_AUTH_MODE") == "token", settings.get("RAY_AUTH_MODE")
    return settings["RAY_AUTH_TOKEN"]


def files_holding(root: Path, secret: str) -> list[Path]:
    needle = secret.encode()
    return [
        path
        for path in root.rglob("*")
        if path.is_file() and not path.is_symlink() and needle in path.read_bytes()
    ]


def test_a_peer_host_cannot_reach_or_join_the_job(hosts_factory, tmp_path: Path) -> None:
    hosts = hosts_factory(3)  # a job of two nodes, and a peer on the same network
    job_hosts, peer = list(hosts)[:2], hosts[2]
    head = job_hosts[0]
    job = Job("sky", job_hosts, tmp_path)
    job.control(hold=True)
    run = job.start()
    job.wait_holding(run)
    token = job.secrets[RAY_TOKEN_SECRET]

    # The dashboard listens on the head's loopback only, and wants the token even there.
    url = f"http://{head.ip}:{DASHBOARD_PORT}/api/version"
    from_peer = on_host(peer, tmp_path, ["python", "-c", HTTP_GET, url])
    assert from_peer.stdout.startswith("unreachable") and "refused" in from_peer.stdout, from_peer
    local = f"http://127.0.0.1:{DASHBOARD_PORT}/api/version"
    on_head = on_host(head, tmp_path, ["python", "-c", HTTP_GET, local])
    assert on_head.stdout.startswith("401") and "Unauthorized" in on_head.stdout, on_head

    # Job submission without the token is refused, even on the head.
    address = f"--address=http://127.0.0.1:{DASHBOARD_PORT}"
    intrusion = ["touch", str(tmp_path / "pwned")]
    submit = on_host(head, tmp_path, ["ray", "job", "submit", address, "--", *intrusion])
    assert submit.returncode != 0 and "authentication token" in submit.stderr, submit
    assert not (tmp_path / "pwned").exists()

    # The GCS answers the job's token only.
    assert REFUSED in count_nodes(peer, tmp_path, head.ip).stderr
    wrong = count_nodes(peer, tmp_path, head.ip, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * 64)
    assert wrong.returncode != 0 and REFUSED in wrong.stderr, wrong
    right = count_nodes(peer, tmp_path, head.ip, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    assert (right.returncode, right.stdout.strip()) == (0, "2"), right  # the control

    # A worker without the token cannot join. (`ray start` tries the GCS 20 times a second
    # apart before it gives up, by default: a few tries get the same refusal.)
    join = on_host(
        peer,
        tmp_path,
        ["ray", "start", f"--address={head.ip}:{GCS_PORT}", "--disable-usage-stats"],
        timeout=180,
        RAY_NUM_REDIS_GET_RETRIES="5",
    )
    assert join.returncode != 0 and REFUSED in join.stderr, join
    after = count_nodes(peer, tmp_path, head.ip, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    assert after.stdout.strip() == "2", after

    (job.out / "release").touch()
    assert job.wait_all(run) == {0: 0, 1: 0}, job.all_logs(run)
    peer.kill_all()  # what the refused `ray start` may have left
    assert_nothing_left(job_hosts)
    assert files_holding(tmp_path, token) == []


def test_the_slurm_script_makes_a_fresh_token_per_job(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    hosts = slurm_cluster.hosts[:2]  # a worker beside the head is all a token needs
    job = Job("slurm", hosts, tmp_path, slurm_cluster)
    try:
        job.control(hold=True)
        first = job.start()
        job.wait_holding(first)
        tokens = {token_of(host) for host in hosts}
        assert len(tokens) == 1, "every node runs with the job's one token"
        token = tokens.pop()
        assert re.fullmatch(r"[0-9a-f]{64}", token)
        assert REFUSED in count_nodes(hosts[1], tmp_path, hosts[0].ip).stderr
        (job.out / "release").touch()
        assert job.wait_all(first) == {0: 0, 1: 0}, job.all_logs(first)
        # Neither the script nor any log of the job holds the token.
        assert files_holding(tmp_path, token) == []

        job.control(exit=0)
        second = job.start()
        assert job.wait_all(second) == {0: 0, 1: 0}, job.all_logs(second)
        assert job.probe(2)["token_set"]
        assert job.probe(1)["token_sha256"] != job.probe(2)["token_sha256"]
    finally:
        slurm_cluster.cancel_all()
        kill_leftovers(slurm_cluster.hosts)


def test_launch_makes_a_fresh_token_per_job() -> None:
    recipe = parse_recipe("name: job\ncommand: [echo hi]\n", "job.yaml").recipe
    first, second = collect_secrets(recipe, {}), collect_secrets(recipe, {})
    assert re.fullmatch(r"[0-9a-f]{64}", first[RAY_TOKEN_SECRET])
    assert first[RAY_TOKEN_SECRET] != second[RAY_TOKEN_SECRET]
    # With ray.auth: none there is no token to hand out (and lint warns about it).
    off = parse_recipe("name: job\ncommand: [echo hi]\nray: {auth: none}\n", "job.yaml").recipe
    assert RAY_TOKEN_SECRET not in collect_secrets(off, {})
