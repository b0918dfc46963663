"""A shell, a command or a port on a running Slurm job's node: `rlx attach` and `rlx tunnel`.

Both run a step inside the job's allocation with `srun --overlap --jobid=ID -w NODE`, so
they share the nodes with the job's own steps instead of waiting for free CPUs. The step
gets RAY_ADDRESS (the job's head), the job's Ray token and its recipe, so `ray status` and
`rlx train` work there; it enters the job's container when the job has one.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from rlx.errors import RlxError
from rlx.launchers.base import Job
from rlx.launchers.keep import token_path
from rlx.launchers.slurm.jobs import attempt_folder, job_hosts, job_state
from rlx.launchers.tunnel import listen, relay_argv, serve
from rlx.node.env import RECIPE_ENV


def job_nodes(job: Job) -> list[str]:
    """The job's nodes, head first, as its driver log names them."""
    hosts = job_hosts(attempt_folder(job))
    if not hosts:
        state = job_state(job)[0]
        raise RlxError(
            f"job {job.name} ({job.handle}) has no nodes yet (state {state}); wait until "
            f"`rlx status {job.name}` says RUNNING"
        )
    return hosts


def step_env(job: Job, head: str, port: int, base: Mapping[str, str]) -> dict[str, str]:
    """The environment of an attached step: the job's Ray, its token, its recipe. SLURM_*
    variables of an enclosing step are dropped, so they do not leak into this one."""
    env = {k: v for k, v in base.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
    env["RAY_ADDRESS"] = f"{head}:{port}"
    token_file = token_path(Path.cwd(), job.name)
    if token_file.exists():
        env["RAY_AUTH_MODE"] = "token"
        env["RAY_AUTH_TOKEN"] = token_file.read_text().strip()
    else:
        env["RAY_AUTH_MODE"] = "disabled"
    if job.recipe:
        env[RECIPE_ENV] = job.recipe
    return env


def step_argv(job: Job, node: str, *, pty: bool, container: Sequence[str]) -> list[str]:
    argv = ["srun", "--overlap", f"--jobid={job.handle}", "--nodes=1", "--ntasks=1"]
    argv.append(f"--nodelist={node}")
    if pty:
        argv.append("--pty")
    return [*argv, *container]


def _pick(job: Job, node: int) -> tuple[list[str], str]:
    nodes = job_nodes(job)
    if not 0 <= node < len(nodes):
        raise RlxError(f"--node {node}: job {job.name} has nodes 0..{len(nodes) - 1}")
    return nodes, nodes[node]


def attach(
    job: Job,
    node: int,
    command: Sequence[str],
    port: int,
    container: Sequence[str],
    prefix: Sequence[str] = (),
) -> int:
    """Run `command` (a login shell without one) on node `node` of the job; its exit code."""
    nodes, target = _pick(job, node)
    env = step_env(job, nodes[0], port, os.environ)
    argv = step_argv(job, target, pty=not command, container=container)
    if not command and list(prefix[:1]) in (["docker"], ["podman"]):
        prefix = [prefix[0], "exec", "-t", *prefix[2:]]  # a terminal for the shell
    argv += [*prefix, *(command or ["bash", "-l"])]
    try:
        return subprocess.call(argv, env=env)
    except FileNotFoundError:
        raise RlxError(
            "`srun` is not installed here; run rlx attach on a Slurm login node"
        ) from None


def tunnel(
    job: Job,
    local_port: int,
    remote_port: int,
    container: Sequence[str],
    prefix: Sequence[str] = (),
) -> None:
    """Forward 127.0.0.1:local_port here to 127.0.0.1:remote_port on the head, until Ctrl-C."""
    _, head = _pick(job, 0)
    # --unbuffered: srun would otherwise hold the relay's output back until a newline.
    step = step_argv(job, head, pty=False, container=container)
    argv = [*step[:2], "--unbuffered", *step[2:], *prefix, *relay_argv(remote_port)]
    try:
        server = listen(local_port)
    except OSError as exc:
        raise RlxError(
            f"cannot listen on 127.0.0.1:{local_port} ({exc.strerror}); pick --port"
        ) from None
    print(
        f"rlx: 127.0.0.1:{local_port} -> {head}:127.0.0.1:{remote_port} (Ctrl-C ends it)",
        flush=True,
    )
    serve(server, argv)
