"""Containers on Slurm: pyxis through srun's own flags, Apptainer per command, and Docker or
Podman as one long-lived container per node that the job's steps run in. Pure: shell text
for the batch script, and the argv that enters a running job's container (`rlx attach`)."""

from __future__ import annotations

import shlex

from rlx.node.env import JOB_DIR_ENV, NODE_HOSTS_ENV, RAY_TOKEN_SECRET, RECIPE_ENV, WHEEL_ENV
from rlx.recipe import Recipe
from rlx.recipe.model import SlurmContainer

# Containers are named after the job, so a requeued or later job never meets this one's.
CONTAINER_NAME = "rlx-${SLURM_JOB_ID}"


CONTAINER_READY_SECONDS = 600
# What a docker/podman container needs to use the node's RDMA devices (resources.fabric efa
# or infiniband): the devices, and the right to lock (register) unlimited memory.
RDMA_FLAGS = ["--device", "/dev/infiniband", "--cap-add", "IPC_LOCK", "--ulimit", "memlock=-1:-1"]


def container_of(recipe: Recipe) -> SlurmContainer | None:
    return recipe.slurm.container if recipe.slurm else None


def bind_mounts(recipe: Recipe, container: SlurmContainer) -> list[str]:
    return [
        *container.mounts,
        *(f"{v.path}:{v.path}" + (":ro" if v.read_only else "") for v in recipe.volumes),
    ]


def pyxis_flags(recipe: Recipe, container: SlurmContainer) -> list[str]:
    q = shlex.quote
    flags = [f"--container-image={q(container.image)}", f'--container-name="{CONTAINER_NAME}"']
    mounts = bind_mounts(recipe, container)
    if mounts:
        flags.append(f"--container-mounts={q(','.join(mounts))}")
    return flags


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


def engine_run_script(recipe: Recipe, container: SlurmContainer) -> str:
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
    if recipe.resources.fast_fabric:
        # EFA and InfiniBand are RDMA devices: NCCL opens them and pins its buffers
        run += RDMA_FLAGS
    for mount in bind_mounts(recipe, container):
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


def engine_rm_script(engine: str) -> str:
    return f'{engine} rm -f "{CONTAINER_NAME}" >/dev/null 2>&1 || true\n'


def engine_ready_script(engine: str) -> str:
    return (
        f"for _ in $(seq {CONTAINER_READY_SECONDS}); do\n"
        f'  if {engine} exec "{CONTAINER_NAME}" true >/dev/null 2>&1; then exit 0; fi\n'
        "  sleep 1\n"
        "done\n"
        f'echo "rlx: the {engine} container did not start on $(hostname) within '
        f'{CONTAINER_READY_SECONDS} s" >&2\n'
        "exit 75\n"
    )


def in_container(recipe: Recipe, argv: str) -> str:
    """`argv` (a shell fragment) as the job's steps run it: inside the container for docker,
    podman and apptainer (pyxis enters it through srun's own flags)."""
    container = container_of(recipe)
    if container is None or container.runtime == "pyxis":
        return argv
    if container.runtime == "apptainer":
        flags = ["--nv"] if recipe.resources.gpus_per_node else []
        mounts = bind_mounts(recipe, container)
        if mounts:
            flags += ["--bind", shlex.quote(",".join(mounts))]
        return " ".join(["apptainer", "exec", *flags, shlex.quote(container.image), argv])
    names = " ".join(f"-e {name}" for name in step_env_names(recipe))
    return f'{container.runtime} exec {names} "{CONTAINER_NAME}" {argv}'


def attach_container(recipe: Recipe | None, job_id: str) -> tuple[list[str], list[str]]:
    """(srun flags, command prefix) that enter the job's own container on a node."""
    container = container_of(recipe) if recipe else None
    name = CONTAINER_NAME.replace("${SLURM_JOB_ID}", job_id)
    if container is None:
        return [], []
    if container.runtime == "pyxis":
        return [f"--container-name={name}"], []
    if container.runtime == "apptainer":
        return [], ["apptainer", "exec", container.image]
    env = ["RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", RECIPE_ENV]
    return [], [container.runtime, "exec", "-i", *(f"-e{n}" for n in env), name]
