"""A cluster that stays up: `rlx launch RECIPE -b sky|dstack|slurm --keep`.

The job forms its Ray cluster as usual, but the head runs no trainer: it holds the cluster
(`rlx hold`, rlx/node/hold.py) while Ray jobs run or wait on it, so `rlx launch -b ray` jobs
and `rlx attach` can use it, and ends once none has for resources.idle_minutes (`none`: until
`rlx down NAME`); the backend then lets the machines go as after any job. Its
dashboard stays on the head's 127.0.0.1; rlx prints the tunnel that reaches it (`ssh -L`
through SkyPilot's or dstack's ssh host, or `rlx tunnel`, which forwards through srun on
Slurm) and keeps the job's Ray token in .rlx/tokens/NAME (mode 0600, on this machine only).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

from rlx.launchers import spec
from rlx.launchers.base import Job, state_dir
from rlx.node.env import RAY_TOKEN_SECRET
from rlx.recipe import Recipe

# The head's command while the cluster is kept: say how to use it, then hold it while it is
# used (its idle limit is the recipe's, which the head reads as every node does).
HOLD_COMMAND = (
    'echo "rlx: cluster kept: $RLX_NUM_NODES node(s), Ray at $RAY_ADDRESS; submit with '
    'rlx launch RECIPE -b ray, end with rlx down"; exec rlx hold'
)


def kept_until(recipe: Recipe) -> str:
    """How long a cluster kept with --keep stays up, in words."""
    minutes = recipe.resources.idle_minutes
    if minutes == "none":
        return "until `rlx down` (resources.idle_minutes: none)"
    return (
        f"until no Ray job has run or waited on it for {minutes} minutes "
        "(resources.idle_minutes), or `rlx down`"
    )


def kept_recipe(recipe: Recipe) -> Recipe:
    """The recipe whose head holds the formed cluster instead of training."""
    return recipe.model_copy(update={"command": [HOLD_COMMAND]})


def token_path(workdir: Path, name: str) -> Path:
    return state_dir(workdir) / "tokens" / name


def save_token(workdir: Path, name: str, token: str) -> Path:
    """The job's Ray token, readable by you alone, on the machine that launched it."""
    path = token_path(workdir, name)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return path


def tunnel_command(job: Job, recipe: Recipe, local_port: int = 8265) -> str | None:
    """The command that brings the head's dashboard to localhost:local_port (the backend
    says how); None where the job has no remote dashboard."""
    return spec(job.backend).tunnel_command(
        job.name, job.handle, recipe.ray.dashboard_port, local_port
    )


def announce(
    job: Job, recipe: Recipe, secrets: Mapping[str, str], workdir: Path, local_port: int = 8265
) -> None:
    """Print how to reach the kept cluster; keep its token for `-b ray` and attach."""
    lines = [f"rlx: {job.name} forms its cluster on {job.backend} and keeps it (no trainer)"]
    lines.append(f"  dashboard tunnel: {tunnel_command(job, recipe, local_port)}")
    exports = f"export RAY_ADDRESS=http://127.0.0.1:{local_port}"
    token = secrets.get(RAY_TOKEN_SECRET)
    if token:
        path = save_token(workdir, job.name, token)
        exports += f" RAY_AUTH_TOKEN=$(cat {path})"
    lines.append(f"  then submit: {exports}; rlx launch RECIPE -b ray")
    if spec(job.backend).can_attach:
        lines.append(f"  a shell on a node: rlx attach {job.name} [--node K] [-- COMMAND]")
    lines.append(f"  it stays up {kept_until(recipe)}; end it: rlx down {job.name}")
    print("\n".join(lines), file=sys.stderr, flush=True)
