"""Slurm: one sbatch script; head and workers start with srun, each with its own log."""

from __future__ import annotations

import math
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from rlx.errors import TRY_AGAIN, RlxError
from rlx.launchers.base import Job, JobStatus, LaunchRequest
from rlx.launchers.common import NODE_RLX_VERSION, NOT_INSTALLED, header_lines, setup_script
from rlx.launchers.keep import save_token
from rlx.launchers.ops_common import save_rendered
from rlx.launchers.slurm import BACKEND
from rlx.node.env import (
    JOB_DIR_ENV,
    NODE_HOSTS_ENV,
    RAY_TOKEN_SECRET,
    RECIPE_ENV,
    WHEEL_ENV,
    recipe_json,
)
from rlx.recipe import Recipe
from rlx.recipe.model import SlurmContainer

# Once the head (or every worker) is done, the other step follows within seconds; past this
# grace period the driver stops it, so a stalled node cannot hold the allocation.
WORKER_GRACE_SECONDS = 30


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
        if slurm.requeue:
            # USR1 to the batch shell (B:) ahead of the end: the trainer checkpoints.
            lines += ["--requeue", f"--signal=B:USR1@{slurm.requeue.signal_lead}"]
            lines.append("--open-mode=append")  # every attempt adds to the same .out file
    lines.append(f"--output={log_dir(recipe)}/%x-%j.out")
    return [f"#SBATCH {line}" for line in lines]


def log_dir(recipe: Recipe) -> str:
    return recipe.slurm.log_dir if recipe.slurm else "rlx-logs"


# Containers are named after the job, so a requeued or later job never meets this one's.
CONTAINER_NAME = "rlx-${SLURM_JOB_ID}"
CONTAINER_READY_SECONDS = 600


def _container(recipe: Recipe) -> SlurmContainer | None:
    return recipe.slurm.container if recipe.slurm else None


def _mounts(recipe: Recipe, container: SlurmContainer) -> list[str]:
    return [
        *container.mounts,
        *(f"{v.path}:{v.path}" + (":ro" if v.read_only else "") for v in recipe.volumes),
    ]


def _pyxis_flags(recipe: Recipe, container: SlurmContainer) -> list[str]:
    q = shlex.quote
    flags = [f"--container-image={q(container.image)}", f'--container-name="{CONTAINER_NAME}"']
    mounts = _mounts(recipe, container)
    if mounts:
        flags.append(f"--container-mounts={q(','.join(mounts))}")
    return flags


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


def step_env_names(recipe: Recipe) -> list[str]:
    """What the job's steps need inside a docker/podman container (passed by name: `-e NAME`
    copies the value from the step's environment, so no value is on a command line)."""
    names = [*recipe.env, RECIPE_ENV, *recipe.secrets]
    if recipe.ray.auth == "token":
        names.append(RAY_TOKEN_SECRET)
    return [
        *names,
        NODE_HOSTS_ENV,
        "RLX_SETUP",
        "RLX_NODE",
        WHEEL_ENV,
        JOB_DIR_ENV,
        "SLURM_JOB_ID",
        "SLURMD_NODENAME",
    ]


def _engine_run_script(recipe: Recipe, container: SlurmContainer) -> str:
    """One long-lived container per node (a step on every node runs this): an init process
    reaps Ray's daemons, host network and shm for Ray and NCCL, the GPUs, the mounts and
    the job's env. It is removed when the step ends: the job finished, failed or was
    cancelled (Slurm sends the step SIGTERM, the trap removes the container)."""
    q = shlex.quote
    engine = container.runtime
    run = [
        engine, "run", "--rm", "--name", '"$name"', "--init", "--network", "host",
        "--shm-size", q(container.shm_size),
    ]  # fmt: skip
    if recipe.resources.gpus_per_node:
        run += ["--gpus", "all"] if engine == "docker" else ["--device", "nvidia.com/gpu=all"]
    for mount in _mounts(recipe, container):
        run += ["-v", q(mount)]
    for name in step_env_names(recipe):
        run += ["-e", name]
    run += [q(container.image), "tail", "-f", "/dev/null"]
    return (
        "\n".join(
            [
                f'name="{CONTAINER_NAME}"',
                f'{engine} rm -f "$name" >/dev/null 2>&1 || true',
                f"trap '{engine} rm -f \"$name\" >/dev/null 2>&1 || true' EXIT",
                "trap 'exit 143' TERM INT",
                " ".join(run) + " &",
                "wait $!",
            ]
        )
        + "\n"
    )


def _engine_rm_script(engine: str) -> str:
    return f'{engine} rm -f "{CONTAINER_NAME}" >/dev/null 2>&1 || true\n'


def _engine_ready_script(engine: str) -> str:
    return (
        f"for _ in $(seq {CONTAINER_READY_SECONDS}); do\n"
        f'  if {engine} exec "{CONTAINER_NAME}" true >/dev/null 2>&1; then exit 0; fi\n'
        "  sleep 1\n"
        "done\n"
        f'echo "rlx: the {engine} container did not start on $(hostname) within '
        f'{CONTAINER_READY_SECONDS} s" >&2\n'
        "exit 75\n"
    )


def _in_container(recipe: Recipe, argv: str) -> str:
    """`argv` (a shell fragment) as the job's steps run it: inside the container for docker,
    podman and apptainer (pyxis enters it through srun's own flags)."""
    container = _container(recipe)
    if container is None or container.runtime == "pyxis":
        return argv
    if container.runtime == "apptainer":
        flags = ["--nv"] if recipe.resources.gpus_per_node else []
        mounts = _mounts(recipe, container)
        if mounts:
            flags += ["--bind", shlex.quote(",".join(mounts))]
        return " ".join(["apptainer", "exec", *flags, shlex.quote(container.image), argv])
    names = " ".join(f"-e {name}" for name in step_env_names(recipe))
    return f'{container.runtime} exec {names} "{CONTAINER_NAME}" {argv}'


def script(recipe: Recipe) -> list[str]:
    """The body of the batch script (after the #SBATCH lines)."""
    q = shlex.quote
    nodes = recipe.resources.nodes
    out = [
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
        f"{NODE_HOSTS_ENV}=$(printf '%s\\n' \"${{nodes[@]}}\")",
        f"export {NODE_HOSTS_ENV}",
        "head_node=${nodes[0]}",
        'echo "rlx: head ${head_node}, nodes: ${nodes[*]}"',
        "",
    ]
    container = _container(recipe)
    flags = _pyxis_flags(recipe, container) if container and container.runtime == "pyxis" else []
    step = " ".join(["srun", "--ntasks-per-node=1", *flags])
    if container and container.runtime in ("docker", "podman"):
        out += [
            "# One container per node for the whole job; the steps below run inside it.",
            "# shellcheck disable=SC2016  # expanded on each node, not here",
            f"export RLX_CONTAINER={q(_engine_run_script(recipe, container))}",
            f"srun --ntasks-per-node=1 --nodes={nodes} --ntasks={nodes} "
            '--output="$job_logs/container-%N.log" bash -c "$RLX_CONTAINER" &',
            "containers_pid=$!",
            "# However this script ends, every node's container is removed: by a step of its",
            "# own first (the container step's trap may not outlive Slurm's KillWait, and the",
            "# container, a child of the engine's monitor, would outlive the step), then by",
            "# ending the container step.",
            "# shellcheck disable=SC2016  # expanded on each node, not here",
            f"export RLX_CONTAINER_RM={q(_engine_rm_script(container.runtime))}",
            "# shellcheck disable=SC2317,SC2329  # called by the trap",
            "remove_containers() {",
            f"  srun --overlap --ntasks-per-node=1 --nodes={nodes} --ntasks={nodes} "
            '--output=/dev/null bash -c "$RLX_CONTAINER_RM" || true',
            '  kill "$containers_pid" 2>/dev/null || true',
            "}",
            "trap remove_containers EXIT",
            "# shellcheck disable=SC2016  # expanded on each node, not here",
            f"export RLX_CONTAINER_READY={q(_engine_ready_script(container.runtime))}",
            f"srun --overlap --ntasks-per-node=1 --nodes={nodes} --ntasks={nodes} "
            'bash -c "$RLX_CONTAINER_READY" || exit 75',
            "",
        ]
        step = "srun --overlap --ntasks-per-node=1"
    setup = setup_script(recipe)
    if setup:
        out += [
            f"export RLX_SETUP={q(setup)}",
            f'{step} --nodes={nodes} --ntasks={nodes} --output="$job_logs/setup-%N.log" '
            + _in_container(recipe, 'bash -c "$RLX_SETUP"'),
            "",
        ]
    out += [
        "# Every node: the shipped rlx when RLX_WHEEL names one, then rlx node.",
        "# shellcheck disable=SC2016  # expanded on each node, not here",
        f"export RLX_NODE={q(NODE_SCRIPT)}",
    ]
    node_cmd = _in_container(recipe, 'bash -c "$RLX_NODE"')
    requeue = recipe.slurm.requeue if recipe.slurm else None
    out += [
        f'{step} --nodes=1 --ntasks=1 --nodelist="$head_node" '
        f'--output="$job_logs/head.log" {node_cmd} &',
        "head_pid=$!",
        *(_warning_trap(nodes) if requeue else []),
    ]
    if nodes > 1:
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
    ]
    lines = [
        "#!/bin/bash",
        *header_lines(recipe, source, how),
        *directives(recipe),
        "",
        *script(recipe),
    ]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- operate
# sbatch submits; the job id is the handle. State comes from squeue while the job is known
# to the controller, then from sacct (or scontrol while it still remembers the job).

TERMINAL = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
}
STATE_NAMES = {
    "COMPLETED": "SUCCEEDED",
    "PENDING": "PENDING",
    "CONFIGURING": "PENDING",
    "RUNNING": "RUNNING",
    "COMPLETING": "RUNNING",
    "CANCELLED": "CANCELLED",
}


def _slurm(
    argv: list[str],
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            env=None if env is None else dict(env),
            cwd=cwd,
            timeout=120,
            check=False,
        )
    except FileNotFoundError:
        raise RlxError(
            f"`{argv[0]}` is not installed here; run rlx on a Slurm login node"
        ) from None
    except subprocess.TimeoutExpired:
        raise RlxError(
            f"`{' '.join(argv[:2])}` did not answer within 120 s; is slurmctld up? (try `sinfo`)"
        ) from None
    if check and proc.returncode != 0:
        message = (proc.stderr or proc.stdout).strip().splitlines()
        raise RlxError(f"{argv[0]} failed: {message[-1] if message else proc.returncode}")
    return proc


def launch(request: LaunchRequest) -> Job:
    script = save_rendered(request, BACKEND.suffix)
    script.chmod(0o755)
    logs_root = request.workdir / log_dir(request.recipe)
    logs_root.mkdir(parents=True, exist_ok=True)
    # Secrets reach the job through sbatch's environment (exported to the job), never a file.
    env = {**os.environ, **request.secrets, WHEEL_ENV: str(_ship_wheel(logs_root))}
    proc = _slurm(["sbatch", "--parsable", str(script)], env=env, cwd=request.workdir)
    job_id = proc.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise RlxError(f"sbatch answered {proc.stdout.strip()!r}, not a job id")
    token = request.secrets.get(RAY_TOKEN_SECRET)
    if token:
        save_token(request.workdir, request.name, token)  # for rlx attach and -b ray
    return Job(
        request.name,
        BACKEND.name,
        job_id,
        request.source,
        str(script),
        extra={"logs": str(logs_root / f"{request.name}-{job_id}")},
    )


def _ship_wheel(logs_root: Path) -> Path:
    """rlx ships itself: a wheel of the running rlx in the jobs' log folder, which every
    node reads (it is where Slurm writes the job's output). Named by version, so a wheel
    already there is the same one."""
    from rlx.launchers.ship import build_wheel, wheel_dir

    wheel = build_wheel(wheel_dir(os.environ))
    shipped = logs_root.resolve() / ".rlx-wheels" / wheel.name
    if not shipped.exists():
        shipped.parent.mkdir(parents=True, exist_ok=True)
        partial = shipped.with_suffix(f".{os.getpid()}.tmp")
        shutil.copyfile(wheel, partial)
        partial.replace(shipped)
    return shipped


def _state(job: Job) -> tuple[str, int | None, str]:
    """(Slurm state, exit code if known, reason)."""
    proc = _slurm(["squeue", "-h", "-j", job.handle, "-o", "%T|%r"], check=False)
    line = proc.stdout.strip()
    if proc.returncode == 0 and line:
        state, _, reason = line.partition("|")
        return state, None, "" if reason in ("None", "") else reason
    proc = _slurm(
        ["sacct", "-n", "-X", "-P", "-j", job.handle, "-o", "State,ExitCode"], check=False
    )
    line = proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else ""
    if proc.returncode == 0 and line:
        state, _, code = line.partition("|")
        return state.split()[0], int(code.split(":")[0] or 0), ""
    proc = _slurm(["scontrol", "show", "job", job.handle, "-o"], check=False)
    fields = dict(kv.split("=", 1) for kv in proc.stdout.split() if "=" in kv)
    if proc.returncode == 0 and "JobState" in fields:
        code = fields.get("ExitCode", "0:0").split(":")[0]
        return fields["JobState"], int(code) if code.isdigit() else None, fields.get("Reason", "")
    return "UNKNOWN", None, "the controller no longer knows this job (see its logs)"


def status(job: Job) -> JobStatus:
    state, code, reason = _state(job)
    shown = STATE_NAMES.get(state, "FAILED" if state in TERMINAL else state)
    if state == "COMPLETED" and code not in (None, 0):
        shown = "FAILED"
    detail = ", ".join(
        x
        for x in (
            state.lower(),
            reason,
            _progress(job),
            f"exit code {code}" if code is not None else "",
        )
        if x
    )
    return JobStatus(job.name, BACKEND.name, shown, detail, code)


def _progress(job: Job) -> str:
    """Training progress when the run folder the head names is on this machine's
    filesystem (Slurm's logging folder is usually shared)."""
    from rlx.runs import progress_detail, run_dir_from_log

    head = attempt_folder(job) / "head.log"
    try:
        run_dir = run_dir_from_log(head.read_text(errors="replace"))
    except OSError:
        return ""
    return (progress_detail(run_dir) or "") if run_dir else ""


def attempt_folder(job: Job) -> Path:
    """The log folder of the job's newest attempt (a requeued job has one per attempt)."""
    first = Path(job.extra["logs"])
    later = [
        (int(p.name.rsplit("attempt", 1)[1]), p)
        for p in first.parent.glob(f"{first.name}-attempt*")
        if p.name.rsplit("attempt", 1)[1].isdigit()
    ]
    return max(later)[1] if later else first


def _log_files(job: Job, node: int | None) -> list[Path]:
    folder = attempt_folder(job)
    if node is None or node == 0:
        return [folder / "head.log"]
    hosts = _job_hosts(folder)
    if not 0 < node < len(hosts):
        raise RlxError(f"node {node} is not in job {job.name} (nodes 0..{max(len(hosts) - 1, 0)})")
    return [folder / f"worker-{hosts[node]}.log"]


def _job_hosts(folder: Path) -> list[str]:
    driver = folder / "driver.log"
    if driver.exists():
        for line in driver.read_text(errors="replace").splitlines():
            if line.startswith("rlx: head ") and ", nodes: " in line:
                return line.split(", nodes: ", 1)[1].split()
    return []


def logs(job: Job, *, follow: bool, node: int | None) -> int:
    files = _log_files(job, node)
    offsets = dict.fromkeys(files, 0)

    def drain() -> None:
        for path in files:
            if path.exists():
                with path.open("rb") as f:
                    f.seek(offsets[path])
                    chunk = f.read()
                offsets[path] += len(chunk)
                sys.stdout.write(chunk.decode(errors="replace"))
        sys.stdout.flush()

    drain()
    if follow:
        while _state(job)[0] not in (*TERMINAL, "UNKNOWN"):
            time.sleep(1.0)
            drain()
        drain()  # what arrived while the job finished
    if not any(path.exists() for path in files):
        raise RlxError(
            f"no log yet at {files[0]} (the job may still be pending: rlx status {job.name})"
        )
    return 0


def down(job: Job) -> None:
    _slurm(["scancel", job.handle])
    for _ in range(120):  # wait until the controller has let go of it
        if _state(job)[0] not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            return
        time.sleep(0.5)


def _job_recipe(job: Job) -> Recipe | None:
    from rlx.launchers.slurm.attach import _rendered_value

    raw = _rendered_value(job, RECIPE_ENV)
    return Recipe.model_validate_json(raw) if raw else None


def _attach_container(recipe: Recipe | None, job_id: str) -> tuple[list[str], list[str]]:
    """(srun flags, command prefix) that enter the job's own container on a node."""
    container = _container(recipe) if recipe else None
    name = CONTAINER_NAME.replace("${SLURM_JOB_ID}", job_id)
    if container is None:
        return [], []
    if container.runtime == "pyxis":
        return [f"--container-name={name}"], []
    if container.runtime == "apptainer":
        return [], ["apptainer", "exec", container.image]
    env = ["RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", RECIPE_ENV]
    return [], [container.runtime, "exec", "-i", *(f"-e{n}" for n in env), name]


def attach(job: Job, node: int, command: list[str]) -> int:
    """A shell (or `command`) on node `node` of the running job, inside its container."""
    from rlx.launchers.slurm.attach import attach as attach_step

    recipe = _job_recipe(job)
    port = recipe.ray.port if recipe else 6379
    flags, prefix = _attach_container(recipe, job.handle)
    return attach_step(job, node, command, port, flags, prefix)


def tunnel(job: Job, local_port: int) -> None:
    """Forward a local port to the head's dashboard through srun, until Ctrl-C."""
    from rlx.launchers.slurm.attach import tunnel as tunnel_step

    recipe = _job_recipe(job)
    remote = recipe.ray.dashboard_port if recipe else 8265
    tunnel_step(job, local_port, remote, *_attach_container(recipe, job.handle))
