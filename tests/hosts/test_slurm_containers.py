"""slurm.container: each runtime's batch script (and the scripts it runs on the nodes)
passes bash -n and shellcheck; the old fields give a migration line; Podman runs for real on
the Slurm across the emulated hosts."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rlx.errors import RecipeError
from rlx.launchers import render
from rlx.launchers.slurm import containers
from rlx.recipe import parse_recipe
from tests.conftest import require

RUNTIMES = ["pyxis", "docker", "podman", "apptainer"]


def recipe_for(runtime: str, gpus: bool = True):
    data = {
        "name": "boxed",
        "resources": {"nodes": 2, **({"accelerators": "H100:8"} if gpus else {})},
        "volumes": [{"path": "/shared"}],
        "setup": ["pip install rlx"],
        "env": {"HF_HOME": "/shared/hf"},
        "secrets": ["HF_TOKEN"],
        "command": ["rlx train"],
        "slurm": {
            "container": {
                "runtime": runtime,
                "image": "img.sif"
                if runtime == "apptainer"
                else "nvcr.io#nvidia/pytorch:24.05-py3",
                "mounts": ["/data:/data:ro"],
            }
        },
    }
    return parse_recipe(yaml.safe_dump(data), "boxed.yaml").recipe


def node_scripts(recipe) -> dict[str, str]:
    """The scripts the batch script hands to `bash -c` on the nodes."""
    container = recipe.slurm.container
    if container.runtime not in ("docker", "podman"):
        return {}
    return {
        "run": containers.engine_run_script(recipe, container),
        "ready": containers.engine_ready_script(container.runtime),
    }


def shellcheck(path: Path) -> None:
    subprocess.run(["bash", "-n", str(path)], check=True)
    done = subprocess.run(
        [require("shellcheck"), "--shell=bash", "--severity=style", str(path)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_each_runtime_passes_shellcheck(runtime: str, tmp_path: Path) -> None:
    text = render("slurm", recipe_for(runtime), "boxed.yaml")
    (tmp_path / "job.sbatch").write_text(text)
    shellcheck(tmp_path / "job.sbatch")
    for name, body in node_scripts(recipe_for(runtime)).items():
        (tmp_path / f"{name}.sh").write_text(body)
        shellcheck(tmp_path / f"{name}.sh")


def test_what_each_runtime_renders() -> None:
    pyxis = render("slurm", recipe_for("pyxis"), "b.yaml")
    assert '--container-name="rlx-${SLURM_JOB_ID}"' in pyxis  # scoped to the job
    assert "--container-mounts=/data:/data:ro,/shared:/shared" in pyxis
    docker = render("slurm", recipe_for("docker"), "b.yaml")
    run = node_scripts(recipe_for("docker"))["run"]
    for part in ("--init", "--network host", "--shm-size 16g", "--gpus all", "-v /data:/data:ro"):
        assert part in run, run
    assert "-e HF_TOKEN" in run and "-e RLX_RAY_TOKEN" in run and "trap" in run
    assert (
        "docker exec -e HF_HOME" in docker and '"rlx-${SLURM_JOB_ID}" bash -c "$RLX_NODE"' in docker
    )
    podman = node_scripts(recipe_for("podman"))["run"]
    assert "--device nvidia.com/gpu=all" in podman and "podman run --rm" in podman
    cpu = node_scripts(recipe_for("podman", gpus=False))["run"]
    assert "nvidia.com/gpu" not in cpu
    apptainer = render("slurm", recipe_for("apptainer"), "b.yaml")
    assert (
        'apptainer exec --nv --bind /data:/data:ro,/shared:/shared img.sif bash -c "$RLX_NODE"'
        in (apptainer)
    )


def test_the_old_fields_say_where_they_moved() -> None:
    text = yaml.safe_dump({"name": "old", "command": ["x"], "slurm": {"container_image": "i"}})
    with pytest.raises(RecipeError) as info:
        parse_recipe(text, "old.yaml")
    assert "container_image moved under slurm.container" in str(info.value)


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
    """Where the offline image is stored (about 2 GB): removed after the test."""
    yield tmp_path / "images"
    shutil.rmtree(tmp_path / "images", ignore_errors=True)


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
        "ray": {"join_timeout": 120},
        "slurm": {"container": {"runtime": "podman", "image": image, "shm_size": "1g"}},
    }
    (tmp_path / "boxed.yaml").write_text(yaml.safe_dump(recipe))
    env = {**os.environ, **slurm_cluster.env, **node_base_env(tmp_path), **conf}
    env = {k: v for k, v in env.items() if v != "" or k == "PATH"}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "rlx", "launch", "boxed.yaml", "-b", "slurm"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    [job_id] = slurm_cluster.active_jobs()
    job = slurm_cluster.wait_job(job_id, timeout=600)
    elapsed = time.monotonic() - started
    folder = tmp_path / "rlx-logs" / f"boxed-{job_id}"
    logs = {p.name: p.read_text(errors="replace") for p in folder.glob("*.log")}
    assert job.state == "COMPLETED" and job.exit_code == 0, logs
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
