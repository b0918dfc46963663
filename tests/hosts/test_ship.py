"""rlx ships itself: the wheel `rlx launch` builds, delivered the way SkyPilot's file mount
and dstack's `files` deliver it, is installed by the rendered run block on three emulated
hosts whose environment has no rlx at all, and the cluster forms with it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlx.launchers.base import LaunchRequest
from rlx.launchers.ship import shipped_version
from tests.support.hosts.probejob import assert_nothing_left, probe_recipe
from tests.support.hosts.rendered import REPO, RenderedJob
from tests.support.slurm_jobs import launch_and_wait

SITE = (
    Path(sys.executable).parent.parent
    / "lib"
    / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    / "site-packages"
)


def clean_env(root: Path) -> Path:
    """A virtualenv with every package of this one but rlx (which it must install itself).
    Made without pip of its own: this one's pip comes through deps like every other package
    (ensurepip would cost about 7 CPU-s a virtualenv, one per host)."""
    deps = root / "deps"
    deps.mkdir(parents=True)
    for entry in SITE.iterdir():
        if entry.name.startswith(("rlx", "_editable_impl_rlx", "__editable__")):
            continue
        (deps / entry.name).symlink_to(entry)
    venv = root / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
    )
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "deps.pth").write_text(str(deps) + "\n")
    return venv


@pytest.mark.hosts
@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", ["sky", "dstack"])
def test_the_run_block_installs_the_shipped_wheel(backend, emulated_hosts, tmp_path: Path):
    pytest.importorskip(backend)
    hosts = emulated_hosts
    (tmp_path / "probe").mkdir()
    (tmp_path / "probe" / "control.json").write_text('{"exit": 0}')
    recipe = probe_recipe(tmp_path / "probe")
    from rlx.launchers import render

    request = LaunchRequest(
        recipe=recipe,
        source="probe.yaml",
        name="probe",
        rendered=render(backend, recipe, "p"),
        secrets={},
        workdir=tmp_path,
    )
    if backend == "sky":
        import sky

        from rlx.launchers.sky.ops import launch_config

        task = sky.Task.from_yaml_config(launch_config(request))
        envs = {k: str(v) for k, v in task.envs.items()}
        [(remote, local)] = [(r, s) for r, s in task.file_mounts.items() if r.endswith(".whl")]
        job = RenderedJob(backend, hosts, tmp_path, task.run, envs, ["RLX_RAY_TOKEN"])
    else:
        from dstack._internal.server.services.jobs.configurators.base import _join_shell_commands

        from rlx.launchers.dstack.ops import configuration

        conf = configuration(request)
        [(remote, local)] = [(f.path, f.local_path) for f in conf.files if f.path.endswith(".whl")]
        envs = {k: v for k, v in conf.env.items() if isinstance(v, str)}
        job = RenderedJob(
            backend,
            hosts,
            tmp_path,
            _join_shell_commands(list(conf.commands)),
            envs,
            ["RLX_RAY_TOKEN"],
        )
    assert envs["RLX_WHEEL"] == remote
    runs = []
    for rank, host in enumerate(hosts):
        home = tmp_path / f"clean-home-{host.name}"
        venv = clean_env(home / "env")
        # Deliver the wheel where the backend would: under the home (SkyPilot's ~ target)
        # or the run's working dir (dstack's relative path, shared here).
        target = (home / remote.removeprefix("~/")) if backend == "sky" else tmp_path / remote
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(local, target)
        (home / "sky_workdir").mkdir(exist_ok=True)
        (home / "sky-user-env" / "bin").mkdir(parents=True, exist_ok=True)
        (home / "sky-user-env" / "bin" / "activate").write_text(f'export PATH={venv}/bin:"$PATH"\n')
        path = f"{venv}/bin:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"
        runs.append(
            job.start(
                rank,
                {"RLX_RAY_TOKEN": "t" * 64},
                extra_env={"HOME": str(home), "PATH": path, "PYTHONPATH": "", "VIRTUAL_ENV": ""},
            )
        )
    codes = [run.wait(300) for run in runs]
    logs = "\n".join(run.output() for run in runs)
    assert codes == [0, 0, 0], logs
    version = shipped_version()
    assert logs.count(f"rlx: installing the launching rlx {version} (this node has none)") == 3, (
        logs
    )
    assert "all 3 nodes joined" in logs
    for host in hosts:
        venv = tmp_path / f"clean-home-{host.name}" / "env" / "venv"
        done = subprocess.run(
            [
                str(venv / "bin" / "python"),
                "-c",
                "import importlib.metadata as m, rlx; print(m.version('rlx'), rlx.__file__)",
            ],
            capture_output=True,
            text=True,
            env={"PATH": "/usr/bin:/bin"},
            cwd=venv,  # not this checkout, which `python -c` would put first on sys.path
            check=True,
        )
        assert done.stdout.split()[0] == version and str(venv) in done.stdout.split()[1]
    assert_nothing_left(hosts)


CHECK = """\
import importlib.metadata as m, os, ray, rlx
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy as On


@ray.remote(num_cpus=0)
def which():
    import importlib.metadata as m, os, rlx
    return os.uname().nodename, m.version("rlx"), rlx.__file__


ray.init()
nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
print("driver", os.uname().nodename, m.version("rlx"), rlx.__file__)
for host, version, path in ray.get([which.options(scheduling_strategy=On(n, False)).remote()
                                    for n in nodes]):
    print("worker", host, version, path)
"""


@pytest.mark.slurm
@pytest.mark.timeout(600)
def test_slurm_nodes_install_the_shipped_wheel_in_the_job_folder(slurm_cluster, tmp_path: Path):
    """`rlx launch -b slurm` from an rlx the nodes do not have: the wheel goes in the job's
    folder, each node installs it in a virtualenv of its own there (the shared environment
    is left as it was), and the driver and Ray's workers on every node run that rlx."""
    shared = clean_env(tmp_path / "site")  # the site's shared environment, without rlx
    (tmp_path / "check.py").write_text(CHECK)
    recipe = {
        "name": "shipped",
        "resources": {"nodes": 3},
        "command": [f"python3 {tmp_path / 'check.py'}"],
        "ray": {"join_timeout": 300},  # a hang bound: a busy machine starts Ray slowly
    }
    (tmp_path / "shipped.yaml").write_text(yaml.safe_dump(recipe))
    path = f"{shared}/bin:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"
    env = {
        "PATH": path,
        "HOME": str(tmp_path),
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
        "LANG": "C.UTF-8",
        **slurm_cluster.env,
    }
    # This checkout's rlx launches (imported from here, not through PYTHONPATH, which sbatch
    # would hand to the job and so to the nodes).
    launcher = f"import sys; sys.path.insert(0, {str(REPO)!r}); from rlx.cli import main; main()"
    argv = [sys.executable, "-c", launcher, "launch", "shipped.yaml", "-b", "slurm"]
    run = launch_and_wait(slurm_cluster, argv, tmp_path, env, "shipped", timeout=420)
    job, folder, logs = run.job, run.folder, run.logs
    version = shipped_version()
    assert job.state == "COMPLETED" and job.exit_code == 0, run.report()
    wheel = tmp_path / "rlx-logs" / ".rlx-wheels" / f"rlx-{version}-py3-none-any.whl"
    assert wheel.is_file()
    head, workers = (
        logs["head.log"],
        [logs[f"worker-{h.name}.log"] for h in slurm_cluster.hosts[1:]],
    )
    for host, log in zip(slurm_cluster.hosts, [head, *workers], strict=True):
        env_dir = folder / f"rlx-env-{host.name}"
        assert f"installing the launching rlx {version} into {env_dir} ({host.name} has none)" in (
            log
        ), log
    reports = [line.split() for line in head.splitlines() if line.startswith(("driver", "worker"))]
    assert sorted(r[1] for r in reports if r[0] == "worker") == [
        h.name for h in slurm_cluster.hosts
    ]
    for _, host, have, where in reports:
        assert have == version and where.startswith(str(folder / f"rlx-env-{host}")), reports
    # The shared environment still has no rlx: nothing was installed into it.
    probe = subprocess.run(
        [
            str(shared / "bin" / "python"),
            "-c",
            "import importlib.util as u; print(u.find_spec('rlx'))",
        ],
        capture_output=True,
        text=True,
        cwd=shared,
        env={"PATH": "/usr/bin:/bin"},
        check=True,
    )
    assert probe.stdout.strip() == "None"
