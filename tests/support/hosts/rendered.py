"""Run a recipe's rendered job on emulated hosts, the way each backend runs it.

- SkyPilot: the task's `run` block, wrapped by SkyPilot's own `make_task_bash_script` (it
  sources ~/.bashrc, activates ~/sky-user-env, cds to ~/sky_workdir and exports the task's
  envs and SkyPilot's node variables) and run as `bash -i SCRIPT`.
- dstack: the task's `commands`, joined by dstack's own `_join_shell_commands` and run as
  `bash -i -c ...`, with the env dstack's server produces (after its `${{ }}`
  interpolation) plus dstack's node variables.
- Slurm: the batch script, submitted with `sbatch` to a real cluster (see `submit_slurm`).

Secrets (the Ray token) reach the node through the process environment, as the backends
deliver them, never through a file. Each host gets its own home folder, as separate machines
would; everything else (the repository, the virtualenv) is shared like an NFS home.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from rlx.launchers import render
from rlx.recipe import Recipe
from tests.support.hosts.env import backend_env
from tests.support.hosts.netns import Host
from tests.support.hosts.procs import HostProcess
from tests.support.hosts.slurm import SlurmCluster

REPO = Path(__file__).resolve().parents[3]
SOURCE = "probe.yaml"  # the recipe path named in the rendered header
HOST_BACKENDS = ("sky", "dstack")  # started host by host; Slurm goes through sbatch


# `rlx` on the hosts: this checkout's rlx under the running interpreter. A host named in
# RLX_TEST_STALLED_HOSTS stalls instead, like a node stuck before its run block gets to
# `rlx node` (a hung setup step, an image that never arrives).
RLX_SHIM = """#!/bin/bash
if [[ " ${{RLX_TEST_STALLED_HOSTS:-}} " == *" $(hostname) "* ]]; then
  echo "rlx-test: $(hostname) stalls before rlx node" >&2
  exec sleep 3600
fi
export PYTHONPATH={repo}${{PYTHONPATH:+:$PYTHONPATH}}
exec {python} -m rlx "$@"
"""


def node_base_env(workdir: Path) -> dict[str, str]:
    """What every node's processes get: `rlx` running this checkout (a shim in
    workdir/bin), the running interpreter's bin folder (ray, uv) on PATH, PYTHONPATH at
    this checkout, and no stray Ray settings from the test runner."""
    shim_dir = workdir / "bin"
    shim = shim_dir / "rlx"
    if not shim.exists():
        shim_dir.mkdir(parents=True, exist_ok=True)
        shim.write_text(RLX_SHIM.format(repo=shlex.quote(str(REPO)), python=sys.executable))
        shim.chmod(0o755)
    bin_dir = str(Path(sys.executable).parent)
    return {
        "PATH": f"{shim_dir}:{bin_dir}:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
        "PYTHONPATH": str(REPO),
        "RAY_ADDRESS": "",
        "RAY_AUTH_MODE": "",
        "RAY_AUTH_TOKEN": "",
        "RLX_RAY_TOKEN": "",
        "VIRTUAL_ENV": "",
    }


def host_home(workdir: Path, host: Host) -> Path:
    """A home folder of `host`, laid out like a SkyPilot node's: ~/sky-user-env activates
    this virtualenv (with the rlx shim first), ~/sky_workdir exists and ~/sky_templates is
    the one shipped with SkyPilot."""
    home = workdir / f"home-{host.name}"
    if not home.exists():
        (home / "sky_workdir").mkdir(parents=True)
        (home / "sky-user-env" / "bin").mkdir(parents=True)
        (home / "sky-user-env" / "bin" / "activate").write_text(
            f"export VIRTUAL_ENV={shlex.quote(sys.prefix)}\n"
            f"export PATH={shlex.quote(str(workdir / 'bin'))}:"
            f'{shlex.quote(str(Path(sys.executable).parent))}:"$PATH"\n'
        )
        templates = sky_templates_dir()
        if templates is not None:
            (home / "sky_templates").symlink_to(templates)
    return home


def sky_templates_dir() -> Path | None:
    try:
        import sky_templates
    except ImportError:
        return None
    return Path(sky_templates.__file__).parent


@dataclass
class NodeRun:
    """One node's run block, running on its host; its output goes to `log`."""

    host: Host
    proc: HostProcess
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill_tree()
            self.proc.wait()
            raise AssertionError(
                f"{self.host.name}: the run block did not end within {timeout:.0f} s\n"
                + self.output()
            ) from None


class RenderedJob:
    """A run block (a recipe rendered for SkyPilot or dstack, or one written by hand),
    ready to start node by node the way that backend would."""

    def __init__(
        self,
        backend: str,
        hosts: Sequence[Host],
        workdir: Path,
        run_block: str,
        envs: Mapping[str, str] | None = None,
        secret_names: Sequence[str] = (),
    ) -> None:
        if backend not in HOST_BACKENDS:
            raise ValueError(f"backend must be one of {HOST_BACKENDS}, got {backend!r}")
        self.backend = backend
        self.hosts = hosts
        self.workdir = workdir
        self.run_block = run_block
        self.envs = dict(envs or {})
        self.secret_names = list(secret_names)

    @classmethod
    def from_recipe(
        cls, backend: str, recipe: Recipe, hosts: Sequence[Host], workdir: Path
    ) -> RenderedJob:
        """Render `recipe` and read the file back with the backend's own parser."""
        rendered = render(backend, recipe, SOURCE)
        if backend == "sky":
            import sky

            task = sky.Task.from_yaml_config(yaml.safe_load(rendered))
            envs = {k: str(v) for k, v in task.envs.items()}
            # Names only in the file (SkyPilot keeps them as references to resolve at
            # launch); `sky launch --secret NAME=VALUE` gives the values.
            names = {*task.secrets, *(ref.name for ref in task.managed_secret_refs)}
            return cls(backend, hosts, workdir, task.run, envs, sorted(names))
        if backend != "dstack":
            raise ValueError(f"backend must be one of {HOST_BACKENDS}, got {backend!r}")
        from dstack._internal.core.models.configurations import parse_run_configuration
        from dstack._internal.server.services.jobs.configurators.base import (
            _join_shell_commands,
        )
        from dstack._internal.utils.interpolator import VariablesInterpolator

        from rlx.launchers.dstack.render import task_text

        conf = parse_run_configuration(task_text(rendered))  # the task (after its fleet)
        interpolate = VariablesInterpolator({"secrets": {}}).interpolate_or_error
        envs = {k: interpolate(v) for k, v in conf.env.items() if isinstance(v, str)}
        # Listed by name only: `dstack apply` takes the values from its environment.
        names = sorted(k for k, v in conf.env.items() if not isinstance(v, str))
        return cls(backend, hosts, workdir, _join_shell_commands(list(conf.commands)), envs, names)

    def node_argv_env(
        self, rank: int, secrets: Mapping[str, str], task_id: str
    ) -> tuple[list[str], dict[str, str]]:
        """The command line and environment the backend would run on node `rank`; the
        secrets the file names get their values from `secrets`, as the backend would."""
        missing = [name for name in self.secret_names if name not in secrets]
        if missing:
            raise ValueError(f"{self.backend}: no value for the secret(s) {', '.join(missing)}")
        given = {name: secrets[name] for name in self.secret_names}
        host = self.hosts[rank]
        injected = backend_env(self.backend, self.hosts, rank, task_id=task_id)
        env = {**node_base_env(self.workdir), "HOME": str(host_home(self.workdir, host))}
        if self.backend == "sky":
            from sky.skylet.log_lib import make_task_bash_script

            # SkyPilot exports envs (and secrets) in the script it writes; the secret stays in
            # the process environment here, so no file of the test holds it.
            script = self.workdir / f"sky-run-{task_id}-{host.name}.sh"
            script.write_text(make_task_bash_script(self.run_block, {**self.envs, **injected}))
            return ["/bin/bash", "-i", str(script)], {**env, **given}
        env = {**env, **self.envs, **injected, **given}
        return ["/bin/bash", "-i", "-c", self.run_block], env

    def start(
        self,
        rank: int,
        secrets: Mapping[str, str],
        *,
        task_id: str = "t1",
        attempt: int = 1,
        extra_env: Mapping[str, str] | None = None,
    ) -> NodeRun:
        """Start node `rank`'s run block; `attempt` numbers retries of the same task."""
        host = self.hosts[rank]
        argv, env = self.node_argv_env(rank, secrets, task_id)
        log = self.workdir / f"{self.backend}-{task_id}-{attempt}-{host.name}.log"
        with open(log, "wb") as out:
            proc = host.popen(
                argv,
                env={**env, **(extra_env or {})},
                cwd=self.workdir,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        return NodeRun(host, proc, log)

    def start_all(
        self,
        secrets: Mapping[str, str],
        *,
        task_id: str = "t1",
        attempt: int = 1,
        skip: tuple[int, ...] = (),
    ) -> list[NodeRun]:
        return [
            self.start(rank, secrets, task_id=task_id, attempt=attempt)
            for rank in range(len(self.hosts))
            if rank not in skip
        ]


def submit_slurm(
    cluster: SlurmCluster,
    recipe: Recipe,
    workdir: Path,
    *,
    extra_env: Mapping[str, str] | None = None,
    nodelist: Sequence[str] = (),
) -> int:
    """Render the batch script, submit it with `sbatch` from `workdir`; the job id. With a
    `nodelist`, the job runs on those nodes only.

    The job inherits the submission environment (sbatch's default), which is how the
    script reaches this checkout's rlx and how a token given in `extra_env` would arrive.
    """
    script = workdir / "job.sbatch"
    script.write_text(render("slurm", recipe, SOURCE))
    (workdir / "rlx-logs").mkdir(exist_ok=True)
    env = {**os.environ, **cluster.env, **node_base_env(workdir), **(extra_env or {})}
    env = {k: v for k, v in env.items() if v != "" or k == "PATH"}
    where = [f"--nodelist={','.join(nodelist)}"] if nodelist else []
    done = subprocess.run(
        ["sbatch", "--parsable", *where, str(script)],
        env=env,
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    job_id = done.stdout.strip().split(";")[0]
    if done.returncode != 0 or not job_id.isdigit():
        raise AssertionError(f"sbatch failed ({done.returncode}): {done.stderr}{done.stdout}")
    return int(job_id)


def slurm_job_dir(workdir: Path, recipe: Recipe, job_id: int) -> Path:
    """The job's log folder: driver.log, head.log, worker-<node>.log."""
    return workdir / "rlx-logs" / f"{recipe.name}-{job_id}"
