"""Slurm: render one sbatch script (render.py, pure; containers.py for the container runtimes),
submit and follow it with Slurm's commands (ops.py, jobs.py), and reach a running job's nodes
(attach.py: `rlx attach`, `rlx tunnel`); checks.py holds its lint checks."""

from __future__ import annotations

from rlx.launchers.spec import BackendSpec

BACKEND = BackendSpec(
    name="slurm",
    title="Slurm",
    section="slurm",
    suffix=".sbatch",
    renders=True,
    executable=True,
    launch_options=frozenset({"keep"}),
    checks="rlx.launchers.slurm.checks",
    restart_setting="slurm.requeue",
    env_prefix="SLURM_",
    can_attach=True,
    forwards=True,
)
