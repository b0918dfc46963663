"""Slurm: one sbatch script; head and workers start with srun, each with its own log."""

from __future__ import annotations

import math
import shlex

from rlx.launchers.common import (
    NOT_INSTALLED,
    RAY_TOKEN_SECRET,
    RECIPE_ENV,
    header_lines,
    recipe_json,
    setup_script,
)
from rlx.recipe import Recipe

NAME = "slurm"
SUFFIX = ".sbatch"

# After the head finishes, workers leave by themselves within seconds; past this grace
# period the driver stops their step so the allocation is given back.
WORKER_GRACE_SECONDS = 60


def _mem(value: str) -> str:
    gb = float(value.rstrip("+"))
    return f"{int(gb)}G" if gb.is_integer() else f"{math.ceil(gb * 1024)}M"


def directives(recipe: Recipe) -> list[str]:
    res, slurm = recipe.resources, recipe.slurm
    lines = [
        f"--job-name={recipe.name}",
        f"--nodes={res.nodes}",
        "--ntasks-per-node=1",
    ]
    if res.gpus_per_node:
        flag = slurm.gpu_flag if slurm else "gpus-per-node"
        lines.append(
            f"--gres=gpu:{res.gpus_per_node}"
            if flag == "gres"
            else f"--gpus-per-node={res.gpus_per_node}"
        )
    if res.cpus:
        lines.append(f"--cpus-per-task={math.ceil(float(res.cpus.rstrip('+')))}")
    if res.memory:
        lines.append(f"--mem={_mem(res.memory)}")
    if slurm:
        for field in ("partition", "account", "qos", "time", "constraint"):
            value = getattr(slurm, field)
            if value is not None:
                lines.append(f"--{field}={value}")
        if slurm.exclusive:
            lines.append("--exclusive")
    lines.append(f"--output={log_dir(recipe)}/%x-%j.out")
    return [f"#SBATCH {line}" for line in lines]


def log_dir(recipe: Recipe) -> str:
    return recipe.slurm.log_dir if recipe.slurm else "rlx-logs"


def _container_flags(recipe: Recipe) -> list[str]:
    slurm = recipe.slurm
    if not slurm or not slurm.container_image:
        return []
    mounts = [
        *slurm.container_mounts,
        *(f"{v.path}:{v.path}" + (":ro" if v.read_only else "") for v in recipe.volumes),
    ]
    flags = [f"--container-image={slurm.container_image}", "--container-name=rlx"]
    if mounts:
        flags.append(f"--container-mounts={','.join(mounts)}")
    return flags


def script(recipe: Recipe) -> list[str]:
    """The body of the batch script (after the #SBATCH lines)."""
    q = shlex.quote
    nodes = recipe.resources.nodes
    out = [
        "set -euo pipefail",
        "",
        "# One folder per job: driver.log (this script), head.log, one log per worker.",
        f'job_logs={q(log_dir(recipe))}/"${{SLURM_JOB_NAME}}-${{SLURM_JOB_ID}}"',
        'mkdir -p "$job_logs"',
        'echo "rlx: logs of this job are in $job_logs"',
        'exec >>"$job_logs/driver.log" 2>&1',
        "",
    ]
    if recipe.slurm and recipe.slurm.modules:
        out += [f"module load {q(m)}" for m in recipe.slurm.modules] + [""]
    out += [f"export {k}={q(v)}" for k, v in recipe.env.items()]
    out.append(f"export {RECIPE_ENV}={q(recipe_json(recipe))}")
    out.append("")
    if recipe.secrets:
        out.append(
            "# Secrets come from the environment sbatch ran in; they are never written to a file."
        )
        for name in recipe.secrets:
            message = (
                f"{name} is not set: export it before submitting (secrets are read from "
                "your environment)"
            )
            out.append(f': "${{{name}:?{message}}}"')
        out.append("")
    if recipe.ray.auth == "token":
        out += [
            "# A fresh Ray token for this job, handed to the job steps through their environment.",
            f'if [[ -z "${{{RAY_TOKEN_SECRET}:-}}" ]]; then',
            f"  {RAY_TOKEN_SECRET}=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \\n')",
            "fi",
            f"export {RAY_TOKEN_SECRET}",
            "",
        ]
    out += [
        'mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        "RLX_NODE_HOSTS=$(printf '%s\\n' \"${nodes[@]}\")",
        "export RLX_NODE_HOSTS",
        "head_node=${nodes[0]}",
        'echo "rlx: head ${head_node}, nodes: ${nodes[*]}"',
        "",
    ]
    container = " ".join(q(f) for f in _container_flags(recipe))
    step = f"srun --ntasks-per-node=1 {container}".rstrip()
    setup = setup_script(recipe)
    if setup:
        out += [
            f"export RLX_SETUP={q(setup)}",
            f'{step} --nodes={nodes} --ntasks={nodes} --output="$job_logs/setup-%N.log" '
            'bash -c "$RLX_SETUP"',
            "",
        ]
    if not recipe.slurm or not recipe.slurm.container_image:
        out += [
            "if ! command -v rlx >/dev/null 2>&1; then",
            f"  echo {q(NOT_INSTALLED)} >&2",
            "  exit 127",
            "fi",
        ]
    out += [
        f'{step} --nodes=1 --ntasks=1 --nodelist="$head_node" '
        f'--output="$job_logs/head.log" rlx node --backend {NAME} &',
        "head_pid=$!",
    ]
    if nodes > 1:
        out += [
            'workers=$(IFS=,; echo "${nodes[*]:1}")',
            f'{step} --nodes={nodes - 1} --ntasks={nodes - 1} --nodelist="$workers" '
            f'--output="$job_logs/worker-%N.log" rlx node --backend {NAME} &',
            "workers_pid=$!",
        ]
    out += [
        "",
        "rc=0",
        'wait "$head_pid" || rc=$?',
        'echo "rlx: head finished with exit code $rc"',
    ]
    if nodes > 1:
        out += [
            f"# Workers follow the head out on their own; stop any still there after "
            f"{WORKER_GRACE_SECONDS} s.",
            f"for _ in $(seq {WORKER_GRACE_SECONDS}); do",
            '  kill -0 "$workers_pid" 2>/dev/null || break',
            "  sleep 1",
            "done",
            'if kill -0 "$workers_pid" 2>/dev/null; then',
            '  echo "rlx: workers still running; stopping them"',
            '  kill -TERM "$workers_pid" 2>/dev/null || true',
            "fi",
            'wait "$workers_pid" || true',
        ]
    out.append('exit "$rc"')
    return out


def render(recipe: Recipe, source: str) -> str:
    how = [
        f"Run with: rlx launch {source} --backend slurm",
        f"(or by hand: mkdir -p {log_dir(recipe)} && sbatch THIS_FILE)",
    ]
    lines = [
        "#!/bin/bash",
        *header_lines(recipe, source, how),
        *directives(recipe),
        "",
        *script(recipe),
    ]
    return "\n".join(lines) + "\n"
