"""Slurm: one sbatch script; head and workers start with srun, each with its own log. Pure:
the script's text from the recipe (containers.py adds the container runtimes' parts).

With resources.groups the script is a heterogeneous job: component 0 the training nodes,
component 1 (after `#SBATCH hetjob`) the rollout nodes, each with its own resources; the
head is the first training node and each step runs in its component (`srun --het-group`)."""

from __future__ import annotations

import math
import shlex

from rlx.errors import TRY_AGAIN
from rlx.launchers.common import (
    NODE_RLX_VERSION,
    NOT_INSTALLED,
    header_lines,
    refuse,
    setup_script,
)
from rlx.launchers.keep import kept_until
from rlx.launchers.offers import node_kinds
from rlx.launchers.slurm.containers import (
    container_of,
    engine_ready_script,
    engine_rm_script,
    engine_run_script,
    in_container,
    pyxis_flags,
)
from rlx.node.env import (
    JOB_DIR_ENV,
    NODE_HOSTS_ENV,
    RAY_TOKEN_SECRET,
    RECIPE_ENV,
    WHEEL_ENV,
    recipe_json,
)
from rlx.recipe import Recipe
from rlx.recipe.model import NodeGroup, Resources, SlurmContainer, duration_seconds

# Once the head (or every worker) is done, the other step follows within seconds; past this
# grace period the driver stops it, so a stalled node cannot hold the allocation.
WORKER_GRACE_SECONDS = 30


# The driver log's line naming the job's nodes, head first: the batch script prints it, and
# `rlx logs --node` and `rlx attach` read it back (nodes_from_driver_log).
NODES_LINE = "rlx: head {head}, nodes: {nodes}"


def nodes_from_driver_log(text: str) -> list[str]:
    """The nodes the NODES_LINE of a driver log names ([] before it is written)."""
    prefix, _, rest = NODES_LINE.partition("{head}")
    separator = rest.partition("{nodes}")[0]
    for line in text.splitlines():
        if line.startswith(prefix) and separator in line:
            return line.split(separator, 1)[1].split()
    return []


def _mem(value: str) -> str:
    gb = float(value.rstrip("+"))
    return f"{int(gb)}G" if gb.is_integer() else f"{math.ceil(gb * 1024)}M"


def _node_lines(recipe: Recipe, shape: Resources | NodeGroup, nodes: int) -> list[str]:
    """What one kind of node asks for: how many, their GPUs, CPUs and memory."""
    slurm = recipe.slurm
    lines = [f"--nodes={nodes}", "--ntasks-per-node=1"]
    if shape.gpus_per_node:
        flag = slurm.gpu_flag if slurm else "gpus-per-node"
        lines.append(
            f"--gres=gpu:{shape.gpus_per_node}"
            if flag == "gres"
            else f"--gpus-per-node={shape.gpus_per_node}"
        )
    if shape.cpus:
        lines.append(f"--cpus-per-task={math.ceil(float(shape.cpus.rstrip('+')))}")
    if shape.memory:
        lines.append(f"--mem={_mem(shape.memory)}")
    return lines


def _constraint(recipe: Recipe, shape: Resources | NodeGroup, more: str | None) -> str | None:
    """The node features to ask for: the features slurm.gpu_features gives this kind of
    node's accelerators, and the recipe's own constraint. Several in Slurm's matching OR,
    [h100|a100]: every node of the job has the same one (a plain h100|a100 lets one job mix
    GPU types across its nodes)."""
    features = recipe.slurm.gpu_features if recipe.slurm else {}
    mapped = list(
        dict.fromkeys(features[o.type] for o in shape.accelerator_options if o.type in features)
    )
    gpus = f"[{'|'.join(mapped)}]" if len(mapped) > 1 else "".join(mapped)
    if not gpus or not more:
        return gpus or more
    return "&".join([gpus, f"({more})" if "|" in more else more])


def slurm_time(seconds: int) -> str:
    """A time limit as Slurm writes one: D-HH:MM:SS, or HH:MM:SS under a day."""
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    clock = f"{hours:02d}:{rest // 60:02d}:{rest % 60:02d}"
    return f"{days}-{clock}" if days else clock


def time_seconds(text: str) -> int:
    """Seconds in a Slurm time limit: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS."""
    days, _, clock = text.rpartition("-")
    parts = [int(part) for part in clock.split(":")]
    if days:  # D-HH[:MM[:SS]]
        hours, minutes, seconds = [*parts, 0, 0][:3]
        return int(days) * 86400 + hours * 3600 + minutes * 60 + seconds
    if len(parts) == 3:
        return parts[0] * 3600 + parts[1] * 60 + parts[2]
    return parts[0] * 60 + (parts[1] if len(parts) == 2 else 0)


def time_limit(recipe: Recipe) -> str | None:
    """--time: resources.max_duration, else slurm.time (refused together)."""
    if recipe.resources.max_duration is not None:
        return slurm_time(duration_seconds(recipe.resources.max_duration))
    return recipe.slurm.time if recipe.slurm else None


def deadline(recipe: Recipe) -> str | None:
    """--deadline from resources.start_deadline. Slurm drops a job that cannot END before
    its deadline (start > deadline - time limit), so the deadline is the start deadline plus
    the time limit (a start deadline without a time limit is refused)."""
    start, limit = recipe.resources.start_deadline, time_limit(recipe)
    if start is None or limit is None:
        return None
    seconds = duration_seconds(start) + time_seconds(limit)
    return f"now+{seconds // 60}minutes" if seconds % 60 == 0 else f"now+{seconds}"


def _job_lines(recipe: Recipe) -> list[str]:
    """Where the job runs, who pays and for how long (every component says it again: Slurm
    does not carry every option over)."""
    slurm = recipe.slurm
    lines = [
        f"--{field}={getattr(slurm, field)}"
        for field in ("partition", "account", "qos")
        if slurm and getattr(slurm, field) is not None
    ]
    limit = time_limit(recipe)
    return lines + ([f"--time={limit}"] if limit else [])


def directives(recipe: Recipe) -> list[str]:
    # here, not at the top: the checks module loads lint, whose storage checks import it
    from rlx.launchers.slurm.checks import RENDER_CHECKS

    refuse(recipe, RENDER_CHECKS)
    res, slurm = recipe.resources, recipe.slurm
    train = res.train_nodes
    lines = [f"--job-name={recipe.name}", *_node_lines(recipe, train, train.nodes)]
    lines += _job_lines(recipe)
    if deadline(recipe):
        lines.append(f"--deadline={deadline(recipe)}")
    constraint = _constraint(recipe, train, slurm.constraint if slurm else None)
    if constraint:
        lines.append(f"--constraint={constraint}")
    if slurm:
        if slurm.exclusive:
            lines.append("--exclusive")
        if slurm.requeue:
            # USR1 to the batch shell (B:) ahead of the end: the trainer checkpoints.
            lines += ["--requeue", f"--signal=B:USR1@{slurm.requeue.signal_lead}"]
            lines.append("--open-mode=append")  # every attempt adds to the same .out file
    lines.append(f"--output={log_dir(recipe)}/%x-%j.out")
    out = [f"#SBATCH {line}" for line in lines]
    rollout = res.rollout_nodes
    if rollout is not None:
        # The second component: the rollout nodes. Where their nodes live and who pays is
        # the job's (said again, as Slurm does not carry every option over); the constraint
        # stays the training nodes'.
        more = _node_lines(recipe, rollout, rollout.nodes)
        constraint = _constraint(recipe, rollout, None)
        if constraint:
            more.append(f"--constraint={constraint}")
        more += _job_lines(recipe)
        if slurm and slurm.exclusive:
            more.append("--exclusive")
        out += ["#SBATCH hetjob", *(f"#SBATCH {line}" for line in more)]
    return out


def log_dir(recipe: Recipe) -> str:
    return recipe.slurm.log_dir if recipe.slurm else "rlx-logs"


# Every node runs this: when RLX_WHEEL names a wheel (rlx launch ships one in the job's
# folder) and this node's rlx is another version, the wheel goes into a virtualenv of the
# node's own in the job's folder, never into the environment the site's users share (nodes
# install at once, and a shared virtualenv is often the one that launched the job). It sees
# every package the node's python3 sees, so nothing is downloaded when the dependencies are
# there; its `rlx` and `ray` come first on PATH, so Ray's workers import the shipped rlx too.
NODE_SCRIPT = (
    """\
if [ -n "${RLX_WHEEL:-}" ]; then
  rlx_want=$(basename "$RLX_WHEEL" | cut -d- -f2)
  """
    + NODE_RLX_VERSION
    + """\
  if [ "$rlx_have" != "$rlx_want" ]; then
    rlx_env="$RLX_JOB_DIR/rlx-env-$(hostname)"
    echo "rlx: installing the launching rlx $rlx_want into $rlx_env" \\
      "($(hostname) has ${rlx_have:-none})"
    python3 -m venv --without-pip "$rlx_env" || exit 1
    rlx_site=$("$rlx_env/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
    python3 -c 'import sys
for path in sys.path:
    if path.endswith(("site-packages", "dist-packages")):
        print("import site; site.addsitedir(%r)" % path)' >"$rlx_site/rlx-node-packages.pth"
    "$rlx_env/bin/python" -m pip install --quiet --disable-pip-version-check \\
      --no-warn-script-location "$RLX_WHEEL" || exit 1
    printf '#!%s\\nfrom ray.scripts.scripts import main\\nmain()\\n' "$rlx_env/bin/python" \\
      >"$rlx_env/bin/ray"
    chmod +x "$rlx_env/bin/ray"
    export PATH="$rlx_env/bin:$PATH"
  fi
fi
if ! command -v rlx >/dev/null 2>&1; then
  echo """
    + shlex.quote(NOT_INSTALLED)
    + """ >&2
  exit 127
fi
exec rlx node --backend slurm
"""
)


def script(recipe: Recipe) -> list[str]:
    """The body of the batch script (after the #SBATCH lines)."""
    nodes = recipe.resources.total_nodes
    grouped = recipe.resources.groups is not None
    out = _job_logs(recipe) + _environment(recipe) + _node_names(grouped)
    container = container_of(recipe)
    flags = pyxis_flags(recipe, container) if container and container.runtime == "pyxis" else []
    step = " ".join(["srun", "--ntasks-per-node=1", *flags])
    if container and container.runtime in ("docker", "podman"):
        out += _containers(recipe, container, nodes)
        step = "srun --overlap --ntasks-per-node=1"
    out += _setup_steps(recipe, step)
    out += _node_steps(recipe, step, grouped, nodes)
    return out


def _job_logs(recipe: Recipe) -> list[str]:
    """The job's log folder (one per attempt when requeued), and the driver's log in it."""
    q = shlex.quote
    return [
        "set -euo pipefail",
        "",
        "# One folder per job: driver.log (this script), head.log, one log per worker.",
        f'job_logs={q(log_dir(recipe))}/"${{SLURM_JOB_NAME}}-${{SLURM_JOB_ID}}"',
        *(
            [
                "# A requeued attempt (SLURM_RESTART_COUNT > 0) logs to a folder of its own.",
                'if [[ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]]; then',
                '  job_logs="$job_logs-attempt$SLURM_RESTART_COUNT"',
                "fi",
            ]
            if recipe.slurm and recipe.slurm.requeue
            else []
        ),
        'mkdir -p "$job_logs"',
        f'{JOB_DIR_ENV}=$(cd "$job_logs" && pwd)',
        f"export {JOB_DIR_ENV}",
        'echo "rlx: logs of this job are in $job_logs"',
        'exec >>"$job_logs/driver.log" 2>&1',
        "",
    ]


def _environment(recipe: Recipe) -> list[str]:
    """Modules, the recipe's env and the recipe itself, its secrets checked present, and a
    fresh Ray token when the recipe asks for one."""
    q = shlex.quote
    out = []
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
    return out


def _node_names(grouped: bool) -> list[str]:
    """The job's nodes in bash's `nodes` (training nodes first in a grouped job), the head
    the first of them."""
    if grouped:
        out = [
            "# A heterogeneous job: component 0 the training nodes, 1 the rollout nodes.",
            'mapfile -t train_nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_0")',
            "mapfile -t rollout_nodes < <(scontrol show hostnames "
            '"$SLURM_JOB_NODELIST_HET_GROUP_1")',
            'nodes=("${train_nodes[@]}" "${rollout_nodes[@]}")',
        ]
    else:
        out = ['mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")']
    return [
        *out,
        f"{NODE_HOSTS_ENV}=$(printf '%s\\n' \"${{nodes[@]}}\")",
        f"export {NODE_HOSTS_ENV}",
        "head_node=${nodes[0]}",
        f'echo "{NODES_LINE.format(head="${head_node}", nodes="${nodes[*]}")}"',
        "",
    ]


def _containers(recipe: Recipe, container: SlurmContainer, nodes: int) -> list[str]:
    """A docker or podman container per node for the whole job, removed however the script
    ends; the script goes on once every node's container is ready."""
    q = shlex.quote
    return [
        "# One container per node for the whole job; the steps below run inside it.",
        "# shellcheck disable=SC2016  # expanded on each node, not here",
        f"export RLX_CONTAINER={q(engine_run_script(recipe, container))}",
        f"srun --ntasks-per-node=1 --nodes={nodes} --ntasks={nodes} "
        '--output="$job_logs/container-%N.log" bash -c "$RLX_CONTAINER" &',
        "containers_pid=$!",
        "# However this script ends, every node's container is removed: by a step of its",
        "# own first (the container step's trap may not outlive Slurm's KillWait, and the",
        "# container, a child of the engine's monitor, would outlive the step), then by",
        "# ending the container step.",
        "# shellcheck disable=SC2016  # expanded on each node, not here",
        f"export RLX_CONTAINER_RM={q(engine_rm_script(container.runtime))}",
        "# shellcheck disable=SC2317,SC2329  # called by the trap",
        "remove_containers() {",
        f"  srun --overlap --ntasks-per-node=1 --nodes={nodes} --ntasks={nodes} "
        '--output=/dev/null bash -c "$RLX_CONTAINER_RM" || true',
        '  kill "$containers_pid" 2>/dev/null || true',
        "}",
        "trap remove_containers EXIT",
        "# shellcheck disable=SC2016  # expanded on each node, not here",
        f"export RLX_CONTAINER_READY={q(engine_ready_script(container.runtime))}",
        f"srun --overlap --ntasks-per-node=1 --nodes={nodes} --ntasks={nodes} "
        'bash -c "$RLX_CONTAINER_READY" || exit 75',
        "",
    ]


def _setup_steps(recipe: Recipe, step: str) -> list[str]:
    """The recipe's setup on every node of each component, when it has one."""
    setup = setup_script(recipe)
    if not setup:
        return []
    out = [f"export RLX_SETUP={shlex.quote(setup)}"]
    for component, count in _components(recipe):
        out.append(
            f"{step}{component} --nodes={count} --ntasks={count} "
            '--output="$job_logs/setup-%N.log" ' + in_container(recipe, 'bash -c "$RLX_SETUP"')
        )
    out.append("")
    return out


def _node_steps(recipe: Recipe, step: str, grouped: bool, nodes: int) -> list[str]:
    """`rlx node` on the head and on the workers, then the wait for the head's exit code
    (and a requeue where the recipe asks for one)."""
    out = [
        "# Every node: the shipped rlx when RLX_WHEEL names one, then rlx node.",
        "# shellcheck disable=SC2016  # expanded on each node, not here",
        f"export RLX_NODE={shlex.quote(NODE_SCRIPT)}",
    ]
    node_cmd = in_container(recipe, 'bash -c "$RLX_NODE"')
    requeue = recipe.slurm.requeue if recipe.slurm else None
    head_component = " --het-group=0" if grouped else ""
    out += [
        f'{step}{head_component} --nodes=1 --ntasks=1 --nodelist="$head_node" '
        f'--output="$job_logs/head.log" {node_cmd} &',
        "head_pid=$!",
        *(_warning_trap(nodes) if requeue else []),
    ]
    if grouped:
        out += _group_workers(recipe, step, node_cmd)
    elif nodes > 1:
        out += [
            'workers=$(IFS=,; echo "${nodes[*]:1}")',
            f'{step} --nodes={nodes - 1} --ntasks={nodes - 1} --nodelist="$workers" '
            f'--output="$job_logs/worker-%N.log" {node_cmd} &',
            "workers_pid=$!",
        ]
    if nodes == 1:
        out += [
            "",
            "rc=0",
            'wait "$head_pid" || rc=$?',
            'echo "rlx: head finished with exit code $rc"',
        ]
    else:
        out += _driver_wait(WORKER_GRACE_SECONDS)
    if requeue:
        out += _requeue(requeue.retries)
    out.append('exit "$rc"')
    return out


def _components(recipe: Recipe) -> list[tuple[str, int]]:
    """(srun's component flag, nodes) per component of the job: one without groups."""
    groups = recipe.resources.node_groups()
    if not groups:
        return [("", recipe.resources.nodes)]
    return [(f" --het-group={i}", group.nodes) for i, (_, group) in enumerate(groups)]


def _group_workers(recipe: Recipe, step: str, node_cmd: str) -> list[str]:
    """The workers of a heterogeneous job: the training nodes after the head (component 0)
    and every rollout node (component 1), a step each, waited for as one."""
    train, rollout = recipe.resources.train_nodes.nodes, recipe.resources.total_nodes
    rollout -= train
    output = '--output="$job_logs/worker-%N.log"'
    rollout_step = (
        f"{step} --het-group=1 --nodes={rollout} --ntasks={rollout} {output} {node_cmd} &"
    )
    if train == 1:
        return [rollout_step, "workers_pid=$!"]
    return [
        "# Both components' workers, waited for as one step.",
        "run_workers() {",
        "  local pids=() rc=0",
        '  workers=$(IFS=,; echo "${train_nodes[*]:1}")',
        f'  {step} --het-group=0 --nodes={train - 1} --ntasks={train - 1} --nodelist="$workers" '
        f"{output} {node_cmd} &",
        "  pids+=($!)",
        f"  {rollout_step}",
        "  pids+=($!)",
        "  # shellcheck disable=SC2317,SC2329  # called by the trap",
        "  trap 'kill -TERM \"${pids[@]}\" 2>/dev/null || true' TERM",
        '  for pid in "${pids[@]}"; do',
        '    wait "$pid" || rc=$?',
        "  done",
        '  return "$rc"',
        "}",
        "run_workers &",
        "workers_pid=$!",
    ]


def _warning_trap(nodes: int) -> list[str]:
    """Slurm's USR1 (time limit or preemption ahead) goes to the head step: the trainer saves
    a checkpoint and exits 75, and the job requeues below."""
    return [
        "# The time-limit / preemption warning: the trainer checkpoints and stops (exit 75).",
        "# shellcheck disable=SC2317,SC2329  # called by the trap",
        "on_warning() {",
        '  echo "rlx: warning signal from Slurm: checkpointing, then requeueing"',
        '  kill -USR1 "$head_pid" 2>/dev/null || true',
        "}",
        "trap on_warning USR1",
    ]


def _requeue(retries: int) -> list[str]:
    """A cluster failure or the warning (exit 75) requeues the job while retries remain; the
    next attempt starts this script again and the trainer resumes from its checkpoint."""
    return [
        "",
        f'if [[ $rc -eq {TRY_AGAIN} && "${{SLURM_RESTART_COUNT:-0}}" -lt {retries} ]]; then',
        '  echo "rlx: attempt $((${SLURM_RESTART_COUNT:-0} + 1)) ended with exit code $rc; '
        f'requeueing (retry $((${{SLURM_RESTART_COUNT:-0}} + 1)) of {retries})"',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "fi",
    ]


def _driver_wait(grace: int) -> list[str]:
    """Wait for the head and worker steps: whichever ends first, the other follows within
    seconds (workers leave once the head is done; a head whose workers all gave up ends
    too). Past `grace` seconds the one left is stopped, so a stalled node cannot hold the
    allocation, and the job's exit code is the head's (the workers' if we stopped it)."""
    return [
        "",
        "# Whichever step ends first, the other follows within seconds; past "
        f"{grace} s it is stopped.",
        'running() { kill -0 "$1" 2>/dev/null; }',
        "# stop_after_grace PID WHAT OTHER: returns 1 when it had to stop the step.",
        "stop_after_grace() {",
        f"  for _ in $(seq {grace}); do",
        '    running "$1" || return 0',
        "    sleep 1",
        "  done",
        f'  echo "rlx: stopping the $2: still running {grace} s after the $3 ended"',
        '  kill -TERM "$1" 2>/dev/null || true',
        "  return 1",
        "}",
        'while running "$head_pid" && running "$workers_pid"; do',
        "  sleep 1",
        "done",
        "rc=0",
        "workers_rc=0",
        'if ! running "$head_pid"; then',
        '  wait "$head_pid" || rc=$?',
        '  echo "rlx: head finished with exit code $rc"',
        '  stop_after_grace "$workers_pid" workers head || true',
        '  wait "$workers_pid" || workers_rc=$?',
        '  echo "rlx: workers finished with exit code $workers_rc"',
        "else",
        '  wait "$workers_pid" || workers_rc=$?',
        '  echo "rlx: workers finished with exit code $workers_rc"',
        "  head_stopped=0",
        '  stop_after_grace "$head_pid" head workers || head_stopped=1',
        '  wait "$head_pid" || rc=$?',
        '  echo "rlx: head finished with exit code $rc"',
        "  # A head we stopped has no outcome of its own: the workers' says what failed.",
        "  if [[ $head_stopped -eq 1 && $workers_rc -ne 0 ]]; then",
        "    rc=$workers_rc",
        "  fi",
        "fi",
    ]


def render(recipe: Recipe, source: str) -> str:
    how = [
        f"Run with: rlx launch {source} --backend slurm",
        f"(or by hand: mkdir -p {log_dir(recipe)} && sbatch THIS_FILE; to ship an rlx wheel "
        f"by hand as rlx launch does, put it on the shared filesystem and submit with "
        f"{WHEEL_ENV}=/shared/path/rlx-VERSION-py3-none-any.whl: each node whose rlx differs "
        "installs it in a virtualenv of its own in the job's log folder)",
        f"The allocation ends with the job; a cluster kept with rlx launch --keep stays "
        f"{kept_until(recipe)}.",
    ]
    lines = [
        "#!/bin/bash",
        *header_lines(recipe, source, how),
        *directives(recipe),
        "",
        *script(recipe),
    ]
    return "\n".join(lines) + "\n"


def alternatives(recipe: Recipe) -> list[str]:
    """What `rlx launch --dry-run` says about the GPUs the job's constraint lets it take."""
    features = recipe.slurm.gpu_features if recipe.slurm else {}
    lines = []
    for path, shape in node_kinds(recipe):
        options = shape.accelerator_options
        if len(options) > 1:
            kind = f"{path[2]} nodes: " if len(path) > 2 else ""
            named = ", ".join(f"{o} ({features.get(o.type)})" for o in options)
            lines.append(f"{kind}Slurm takes nodes with any of these GPUs (feature): {named}")
    return lines
