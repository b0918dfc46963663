"""rlx ships itself: the wheel `rlx launch` builds, delivered the way SkyPilot's file mount
and dstack's `files` deliver it, is installed by the rendered run block on three emulated
hosts whose environment has no rlx at all, and the cluster forms with it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from rlx.errors import RlxError
from rlx.launchers.base import LaunchRequest
from rlx.launchers.ship import build_wheel, check_node_version, shipped_version
from tests.hosts.probejob import assert_nothing_left, probe_recipe
from tests.hosts.rendered import RenderedJob

SITE = (
    Path(sys.executable).parent.parent
    / "lib"
    / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    / "site-packages"
)


def test_the_wheel_is_this_rlx_and_installs(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path)
    assert wheel.name == f"rlx-{shipped_version()}-py3-none-any.whl"
    assert build_wheel(tmp_path) == wheel  # reused, not rebuilt
    names = zipfile.ZipFile(wheel).namelist()
    assert "rlx/cli.py" in names and "rlx/launchers/ship.py" in names
    assert not any("__pycache__" in n for n in names)
    with pytest.raises(RlxError, match=r"this node runs rlx .*launched with rlx 9\.9"):
        check_node_version({"RLX_WHEEL": "/x/rlx-9.9+gabc-py3-none-any.whl"})
    check_node_version({})


def clean_env(root: Path) -> Path:
    """A virtualenv with every package of this one but rlx (which it must install itself)."""
    deps = root / "deps"
    deps.mkdir(parents=True)
    for entry in SITE.iterdir():
        if entry.name.startswith(("rlx", "_editable_impl_rlx", "__editable__")):
            continue
        (deps / entry.name).symlink_to(entry)
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "deps.pth").write_text(str(deps) + "\n")
    ray = venv / "bin" / "ray"
    ray.write_text(f"#!{venv}/bin/python\nfrom ray.scripts.scripts import main\nmain()\n")
    ray.chmod(0o755)
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

        from rlx.launchers.sky_ops import launch_config

        task = sky.Task.from_yaml_config(launch_config(request))
        envs = {k: str(v) for k, v in task.envs.items()}
        [(remote, local)] = [(r, s) for r, s in task.file_mounts.items() if r.endswith(".whl")]
        job = RenderedJob(backend, hosts, tmp_path, task.run, envs, ["RLX_RAY_TOKEN"])
    else:
        from dstack._internal.server.services.jobs.configurators.base import _join_shell_commands

        from rlx.launchers.dstack_ops import configuration

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
