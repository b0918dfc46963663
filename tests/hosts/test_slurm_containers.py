"""slurm.container with Podman, for real, on the Slurm across the emulated hosts (what each
runtime renders: tests/unit/launchers/test_slurm_containers.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.support.slurm_jobs import launch_and_wait

CHECK = """\
import importlib.metadata as m, os, ray, rlx
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy as On


@ray.remote(num_cpus=0)
def where():
    import os
    return os.uname().nodename, os.path.exists("/run/.containerenv")


ray.init()
nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
print("driver", os.path.exists("/run/.containerenv"), m.version("rlx"), rlx.__file__)
for host, boxed in ray.get([where.options(scheduling_strategy=On(n, False)).remote()
                            for n in nodes]):
    print("task", host, boxed)
"""


@pytest.fixture
def image_store(tmp_path: Path):
    """Where the offline image is stored (about 2 GB): removed after the test, in the
    background (a minute of file deletions the next test need not wait for)."""
    yield tmp_path / "images"
    if (tmp_path / "images").exists():
        subprocess.Popen(["rm", "-rf", str(tmp_path / "images")], start_new_session=True)


@pytest.mark.slurm
@pytest.mark.timeout(900)
def test_podman_containers_on_the_real_slurm(slurm_cluster, image_store, tmp_path: Path) -> None:
    """slurm.container with runtime podman, for real: an image made offline (this machine's
    Python, Ray and this rlx), one container per node, the cluster forms inside them, the
    command runs in the head's, and every container is gone when the job ends."""
    from tests.support.hosts.podman import build_image, podman_unavailable_reason, write_config
    from tests.support.hosts.rendered import node_base_env

    reason = podman_unavailable_reason()
    if reason:
        pytest.skip(reason)
    started = time.monotonic()
    image = build_image(tmp_path / "image", image_store)
    built = time.monotonic() - started
    conf = write_config(tmp_path, image_store)
    (tmp_path / "check.py").write_text(CHECK)
    recipe = {
        "name": "boxed",
        "resources": {"nodes": 3},
        "volumes": [{"path": str(tmp_path)}],
        "command": [f"python3 {tmp_path / 'check.py'}"],
        "ray": {"join_timeout": 300},  # a hang bound: a busy machine starts Ray slowly
        "slurm": {"container": {"runtime": "podman", "image": image, "shm_size": "1g"}},
    }
    (tmp_path / "boxed.yaml").write_text(yaml.safe_dump(recipe))
    env = {**os.environ, **slurm_cluster.env, **node_base_env(tmp_path), **conf}
    env = {k: v for k, v in env.items() if v != "" or k == "PATH"}
    argv = [sys.executable, "-m", "rlx", "launch", "boxed.yaml", "-b", "slurm"]
    run = launch_and_wait(slurm_cluster, argv, tmp_path, env, "boxed", timeout=600)
    job, folder, logs, elapsed = run.job, run.folder, run.logs, run.seconds
    assert job.state == "COMPLETED" and job.exit_code == 0, run.report()
    head = logs["head.log"]
    assert "all 3 nodes joined" in head, head
    driver = next(line.split() for line in head.splitlines() if line.startswith("driver "))
    assert driver[1] == "True" and driver[3] == "/opt/rlx/rlx/__init__.py", driver
    tasks = sorted(line.split()[1:] for line in head.splitlines() if line.startswith("task "))
    assert tasks == [[h.name, "True"] for h in slurm_cluster.hosts], tasks
    # The image's rlx is the launching one: the version check passes, nothing is installed.
    assert not list(folder.glob("rlx-env-*")), sorted(p.name for p in folder.iterdir())
    print(f"podman on Slurm: image built in {built:.1f} s, job done in {elapsed:.1f} s")
    # The containers are removed when the job ends.
    for host in slurm_cluster.hosts:
        deadline = time.monotonic() + 60
        while True:
            ps = host.run(["podman", "ps", "-a", "--format", "{{.Names}}"], env={**env, **conf})
            assert ps.returncode == 0, ps.stderr
            if not ps.stdout.strip() or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert ps.stdout.strip() == "", f"{host.name}: {ps.stdout}"
