"""`rlx lint`: what a seasoned user checks before paying for GPUs.

Each check is a small function from a loaded recipe to findings; CHECKS lists them all.
Checks that concern one backend run when the recipe has that backend's section.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from rlx.errors import Finding, RecipeError, RlxError
from rlx.recipe import LoadedRecipe, Recipe, load_recipe
from rlx.recipe.model import is_bucket

ERROR, WARNING = "error", "warning"

# Ports SkyPilot's own Ray holds on every node of a SkyPilot cluster.
SKYPILOT_PORTS = {
    6380: "SkyPilot's Ray GCS",
    8266: "SkyPilot's Ray dashboard",
    8076: "SkyPilot's Ray object manager",
    10001: "SkyPilot's Ray client server",
    52365: "SkyPilot's Ray dashboard agent",
}
SKYPILOT_WORKER_PORTS = range(11002, 20000)
RESERVED_ENV_PREFIXES = ("SKYPILOT_", "DSTACK_", "SLURM_", "RLX_")
SECRET_WORDS = {"TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIALS", "APIKEY"}
SECRET_SUFFIXES = ("API_KEY", "ACCESS_KEY", "SECRET_KEY", "PRIVATE_KEY", "AUTH_KEY")
SECRET_LIKE_VALUE = re.compile(
    r"^(hf_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_-]{20,}|gh[pousr]_[A-Za-z0-9]{20,}"
    r"|AKIA[0-9A-Z]{16}|xox[abp]-[A-Za-z0-9-]{10,})"
)

Check = Callable[[LoadedRecipe], Iterable[Finding]]


# --------------------------------------------------------------------------- helpers


def _secret_like_name(name: str) -> bool:
    """HF_TOKEN or WANDB_API_KEY, but not TOKENIZERS_PARALLELISM."""
    upper = name.upper()
    return bool(SECRET_WORDS & set(upper.split("_"))) or upper.endswith(SECRET_SUFFIXES)


def _ray_ports(recipe: Recipe) -> dict[str, int]:
    ray = recipe.ray
    return {
        "port": ray.port,
        "dashboard_port": ray.dashboard_port,
        "dashboard_agent_port": ray.dashboard_agent_port,
        "object_manager_port": ray.object_manager_port,
        "node_manager_port": ray.node_manager_port,
        "client_server_port": ray.client_server_port,
    }


def _retries_on(recipe: Recipe) -> str | None:
    """Which setting restarts the job on failure, if any."""
    if recipe.sky and recipe.sky.recovery:
        return "sky.recovery"
    if recipe.dstack and recipe.dstack.retry:
        return "dstack.retry"
    return None


def _is_local_path(path: str) -> bool:
    return path.startswith(("/", "./", "../", "~")) or path in (".", "..")


def _shared_roots(recipe: Recipe, *, writable: bool) -> list[str]:
    """Paths every node sees with the same content. File mounts of local files are copies,
    fine to read but not to write; bucket mounts and volumes are shared both ways."""
    roots = [v.path for v in recipe.volumes if not (writable and v.read_only)]
    for target, source in recipe.file_mounts.items():
        if is_bucket(source) or not writable:
            roots.append(target.rstrip("/") or "/")
    return roots


def _under(path: str, roots: Iterable[str]) -> bool:
    path = path.rstrip("/")
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


def _dp_ranks(recipe: Recipe) -> int:
    """Training (data-parallel) ranks, as the trainer will place them: one per training GPU,
    or one per node on CPU-only jobs."""
    from rlx.trainer.actors.placement import plan_actors  # light: no torch or ray at import

    try:
        return plan_actors(recipe).train_workers
    except RlxError:  # an impossible split layout; check_layout reports it
        return max(recipe.resources.total_gpus, 1)


# --------------------------------------------------------------------------- checks


def check_has_work(lr: LoadedRecipe) -> Iterator[Finding]:
    if lr.recipe.trainer is None and lr.recipe.command is None:
        yield lr.finding(
            ("trainer",),
            ERROR,
            "nothing to run: add a 'trainer:' section, or a 'command:' for your own program",
        )


def check_batch_divisibility(lr: LoadedRecipe) -> Iterator[Finding]:
    trainer = lr.recipe.trainer
    if trainer is None:
        return
    batch, ranks = trainer.batch, _dp_ranks(lr.recipe)
    step = batch.prompts_per_step * trainer.rollout.n
    minibatch = batch.minibatch_size or step
    where = ("trainer", "batch")
    if step % ranks:
        yield lr.finding(
            (*where, "prompts_per_step"),
            ERROR,
            f"prompts_per_step x rollout.n = {step} sequences do not split evenly "
            f"over {ranks} training workers; make it a multiple of {ranks}",
        )
    elif step % minibatch:
        yield lr.finding(
            (*where, "minibatch_size"),
            ERROR,
            f"minibatch_size {minibatch} does not divide the {step} sequences of a "
            "step; pick a divisor",
        )
    elif minibatch % ranks:
        yield lr.finding(
            (*where, "minibatch_size"),
            ERROR,
            f"minibatch_size {minibatch} does not split over {ranks} training workers; "
            f"make it a multiple of {ranks}",
        )
    elif batch.micro_batch_size > minibatch // ranks:
        yield lr.finding(
            (*where, "micro_batch_size"),
            WARNING,
            f"micro_batch_size {batch.micro_batch_size} is larger than the "
            f"{minibatch // ranks} sequences each training worker gets per minibatch, so "
            f"micro-batches hold {minibatch // ranks}; lower it to say so",
        )


def check_tensor_parallel(lr: LoadedRecipe) -> Iterator[Finding]:
    trainer, gpus = lr.recipe.trainer, lr.recipe.resources.gpus_per_node
    if trainer is None:
        return
    tp = trainer.rollout.tensor_parallel_size
    if tp > 1 and (gpus == 0 or gpus % tp):
        yield lr.finding(
            ("trainer", "rollout", "tensor_parallel_size"),
            ERROR,
            f"tensor_parallel_size {tp} does not divide the {gpus} GPUs per node; "
            "an engine must fit on one node",
        )


def check_rollout_engine(lr: LoadedRecipe) -> Iterator[Finding]:
    trainer = lr.recipe.trainer
    if trainer is None:
        return
    rollout = trainer.rollout
    if rollout.min_new_tokens > rollout.max_new_tokens:
        yield lr.finding(
            ("trainer", "rollout", "min_new_tokens"),
            ERROR,
            f"min_new_tokens {rollout.min_new_tokens} exceeds max_new_tokens "
            f"{rollout.max_new_tokens}",
        )


def check_group_size(lr: LoadedRecipe) -> Iterator[Finding]:
    trainer = lr.recipe.trainer
    if trainer and trainer.algorithm in ("grpo", "rloo") and trainer.rollout.n < 2:
        yield lr.finding(
            ("trainer", "rollout", "n"),
            ERROR,
            f"{trainer.algorithm} compares responses within a group, so rollout.n "
            "must be at least 2 (8 or 16 is typical)",
        )


def check_layout(lr: LoadedRecipe) -> Iterator[Finding]:
    trainer = lr.recipe.trainer
    if trainer is None:
        return
    total = lr.recipe.resources.total_gpus
    tp = trainer.rollout.tensor_parallel_size
    if trainer.layout == "split" and total > 0:
        if not 0 < trainer.rollout_gpus < total:
            yield lr.finding(
                ("trainer", "rollout_gpus"),
                ERROR,
                f"layout: split needs 0 < rollout_gpus < {total} (the job's GPUs) "
                "so both training and rollout get GPUs",
            )
        elif trainer.rollout_gpus % tp:
            yield lr.finding(
                ("trainer", "rollout_gpus"),
                ERROR,
                f"rollout_gpus {trainer.rollout_gpus} is not a multiple of "
                f"tensor_parallel_size {tp}",
            )
    elif trainer.rollout_gpus:
        yield lr.finding(
            ("trainer", "rollout_gpus"), WARNING, "rollout_gpus is ignored with layout: colocated"
        )


def check_colocated_tensor_parallel(lr: LoadedRecipe) -> Iterator[Finding]:
    trainer = lr.recipe.trainer
    if trainer is None:
        return
    tp = trainer.rollout.tensor_parallel_size
    if tp == 1 or lr.recipe.resources.gpus_per_node == 0:
        return
    where = ("trainer", "rollout", "tensor_parallel_size")
    if trainer.rollout.engine == "hf":
        yield lr.finding(
            where,
            ERROR,
            f"tensor_parallel_size {tp} needs engine: vllm (an hf engine runs on one GPU); "
            "set engine: vllm, or tensor_parallel_size: 1",
        )
    elif trainer.layout == "colocated":
        yield lr.finding(
            where,
            ERROR,
            f"tensor_parallel_size {tp} needs layout: split with rollout_gpus a multiple of "
            f"{tp} (colocated engines run one per training GPU)",
        )


# Synthetic tasks rlx.trainer.resolve can generate (kept equal to it by a test).
SYNTHETIC_TASKS = ("letters_or_digits", "arithmetic")


def check_trainer_specs(lr: LoadedRecipe) -> Iterator[Finding]:
    """The names the trainer resolves on the head before any worker starts: tiny model
    specs, synthetic tasks and built-in rewards."""
    from rlx.plan.shapes import TINY_HEADS, TINY_SPEC
    from rlx.trainer.learn.tiny import ARCHS
    from rlx.trainer.tasks.rewards import REWARD_FUNCTIONS

    trainer = lr.recipe.trainer
    if trainer is None:
        return
    models = [("model", trainer.model.path)]
    if trainer.algorithm == "ppo" and trainer.critic_model is not None:
        models.append(("critic_model", trainer.critic_model.path))
    for field, spec in models:
        if not spec.startswith("tiny:"):
            continue
        match = TINY_SPEC.fullmatch(spec)
        problem = None
        if match is None:
            problem = "is not a tiny model spec; write tiny:<arch>-h<hidden>-l<layers>"
        elif match["arch"] not in ARCHS:
            problem = f"tiny arch {match['arch']!r} is not one of {', '.join(ARCHS)}"
        elif int(match["hidden"]) < TINY_HEADS or int(match["hidden"]) % TINY_HEADS:
            problem = f"tiny models need a hidden size that is a multiple of {TINY_HEADS}"
        elif int(match["layers"]) < 1:
            problem = "tiny models need at least one layer"
        if problem:
            yield lr.finding(("trainer", field, "path"), ERROR, f"{spec!r} {problem}")
    data = trainer.data.train
    datasets = [(("trainer", "data", "train"), data)]
    if trainer.validation is not None:
        datasets.append((("trainer", "validation", "data"), trainer.validation.data))
    for where, spec in datasets:
        if spec.startswith("synthetic:") and spec.removeprefix("synthetic:") not in SYNTHETIC_TASKS:
            yield lr.finding(
                where,
                ERROR,
                f"unknown synthetic task {spec!r}; valid: "
                + ", ".join(f"synthetic:{task}" for task in SYNTHETIC_TASKS),
            )
    reward = trainer.reward.function
    target, colon, name = reward.rpartition(":")
    if not colon and reward not in REWARD_FUNCTIONS:
        yield lr.finding(
            ("trainer", "reward", "function"),
            ERROR,
            f"unknown reward {reward!r}; valid: {', '.join(sorted(REWARD_FUNCTIONS))}, or "
            "'package.module:function' or 'path/to/file.py:function'",
        )
    elif colon and (not target or not name.isidentifier()):
        yield lr.finding(
            ("trainer", "reward", "function"),
            ERROR,
            f"bad reward spec {reward!r}; write 'package.module:function' or "
            "'path/to/file.py:function'",
        )
    elif reward == "math_exact" and "math" in data.lower():
        yield lr.finding(
            ("trainer", "reward", "function"),
            WARNING,
            "math_exact scores 1 only when the WHOLE response equals the answer, so "
            "'The answer is \\boxed{5}.' scores 0; use math_verify for MATH-style answers",
        )


def check_memory_plan(lr: LoadedRecipe) -> Iterator[Finding]:
    """`rlx plan`'s verdict: a plan that does not fit is an error saying what to change."""
    from rlx.plan import PlanError, plan_recipe

    recipe = lr.recipe
    if recipe.trainer is None or recipe.command is not None:
        return
    try:
        plan = plan_recipe(recipe)
    except PlanError as exc:
        yield lr.finding(
            ("trainer", "model", "path"), WARNING, f"memory not checked: {str(exc).rstrip('.')}"
        )
        return
    except RlxError:  # an impossible layout: check_layout says so
        return
    where = ("resources", "accelerators") if recipe.resources.accelerators else ("resources",)
    for problem in plan.problems:
        field = ("resources", "memory") if problem.startswith("host") else where
        yield lr.finding(field, ERROR, f"does not fit: {problem}")
    for warning in plan.warnings:
        field = ("resources", "memory") if warning.startswith("host") else where
        yield lr.finding(field, WARNING, f"tight: {warning}")


def check_ray_ports(lr: LoadedRecipe) -> Iterator[Finding]:
    ports = _ray_ports(lr.recipe)
    worker_range = range(lr.recipe.ray.min_worker_port, lr.recipe.ray.max_worker_port + 1)
    if not worker_range:
        yield lr.finding(
            ("ray", "max_worker_port"), ERROR, "max_worker_port must be above min_worker_port"
        )
    seen: dict[int, str] = {}
    for field, port in ports.items():
        if port in SKYPILOT_PORTS:
            yield lr.finding(
                ("ray", field),
                ERROR,
                f"port {port} is {SKYPILOT_PORTS[port]} on every SkyPilot node; pick another port",
            )
        elif port in SKYPILOT_WORKER_PORTS:
            yield lr.finding(
                ("ray", field),
                ERROR,
                f"port {port} is in SkyPilot's Ray worker range 11002-19999; pick "
                "a port outside it",
            )
        if port in seen:
            yield lr.finding(
                ("ray", field),
                ERROR,
                f"port {port} is also ray.{seen[port]}; every Ray port must differ",
            )
        seen.setdefault(port, field)
        if port in worker_range:
            yield lr.finding(
                ("ray", field),
                ERROR,
                f"port {port} lies inside the worker port range "
                f"{worker_range.start}-{worker_range.stop - 1}",
            )
    if set(worker_range) & set(SKYPILOT_WORKER_PORTS):
        yield lr.finding(
            ("ray", "min_worker_port"),
            ERROR,
            "the worker port range overlaps SkyPilot's Ray workers (11002-19999)",
        )


def check_public_ports(lr: LoadedRecipe) -> Iterator[Finding]:
    public = set(lr.recipe.resources.expanded_ports())
    ray_ports = _ray_ports(lr.recipe)
    for field, port in ray_ports.items():
        if port in public:
            yield lr.finding(
                ("resources", "ports"),
                ERROR,
                f"ray.{field} {port} is opened to the internet; anyone could join "
                "the cluster or submit jobs. Remove it and use an SSH tunnel",
            )
    ray = lr.recipe.ray
    if public & set(range(ray.min_worker_port, ray.max_worker_port + 1)):
        yield lr.finding(
            ("resources", "ports"),
            ERROR,
            "a public port lies in Ray's worker port range; remove it",
        )


def check_dashboard_host(lr: LoadedRecipe) -> Iterator[Finding]:
    host = lr.recipe.ray.dashboard_host
    if host in ("0.0.0.0", "::", "[::]", "*"):
        yield lr.finding(
            ("ray", "dashboard_host"),
            ERROR,
            f"{host} opens the Ray dashboard (and job submission) to the network; "
            "keep 127.0.0.1 and use an SSH tunnel",
        )
    elif host not in ("127.0.0.1", "localhost", "::1"):
        yield lr.finding(
            ("ray", "dashboard_host"),
            WARNING,
            f"the dashboard binds {host}, reachable from other machines; 127.0.0.1 is safer",
        )


def check_auth(lr: LoadedRecipe) -> Iterator[Finding]:
    if lr.recipe.ray.auth == "none":
        yield lr.finding(
            ("ray", "auth"),
            WARNING,
            "without token auth anyone who reaches the head's Ray port can join "
            "the cluster and run code; keep auth: token unless the network is "
            "private",
        )


def check_debugger(lr: LoadedRecipe) -> Iterator[Finding]:
    if lr.recipe.ray.debug == "legacy":
        yield lr.finding(
            ("ray", "debug"),
            WARNING,
            "legacy starts Ray with --ray-debugger-external: a paused task's pdb listens on "
            "the node's address, unauthenticated, for anyone who reaches it; use "
            "post-mortem or breakpoints (debugpy, reached through the dashboard) unless a "
            "firewall closes the nodes",
        )


def check_secrets_in_env(lr: LoadedRecipe) -> Iterator[Finding]:
    recipe = lr.recipe
    for i, name in enumerate(recipe.secrets):
        if SECRET_LIKE_VALUE.match(name):
            # Never echo it: it is most likely a real credential.
            yield lr.finding(
                ("secrets", i),
                ERROR,
                f"entry {i} looks like a credential, not a "
                "name; list secret NAMES only (e.g. HF_TOKEN) and revoke that one",
            )
    for name, value in recipe.env.items():
        where = ("env", name)
        if name in recipe.secrets:
            yield lr.finding(
                where,
                ERROR,
                f"{name} is listed under secrets; remove its value "
                "from env (secret values are read from your environment at launch)",
            )
        elif SECRET_LIKE_VALUE.match(value):
            yield lr.finding(
                where,
                ERROR,
                "this value looks like a credential; remove it, "
                f"list '{name}' under secrets and export it before launch",
            )
        elif _secret_like_name(name) and value:
            yield lr.finding(
                where,
                ERROR,
                f"{name} looks like a secret written in plain text; "
                "list the name under secrets and export the value before launch",
            )
        if "${{" in value:
            yield lr.finding(
                where,
                ERROR,
                "'${{ ... }}' is dstack interpolation and is passed "
                "literally here; list the variable under secrets instead",
            )


def check_reserved_env(lr: LoadedRecipe) -> Iterator[Finding]:
    for name in [*lr.recipe.env, *lr.recipe.secrets]:
        section = "env" if name in lr.recipe.env else "secrets"
        where = (section, name) if section == "env" else (section,)
        if name.startswith(RESERVED_ENV_PREFIXES) or name in (
            "RAY_ADDRESS",
            "RAY_AUTH_TOKEN",
            "RAY_AUTH_MODE",
        ):
            yield lr.finding(where, ERROR, f"{name} is set by the backend or by rlx; remove it")


def check_setup_commands(lr: LoadedRecipe) -> Iterator[Finding]:
    for i, command in enumerate(lr.recipe.setup):
        if re.search(r"\bray\s+stop\b", command):
            yield lr.finding(
                ("setup", i),
                ERROR,
                "'ray stop' stops every Ray on the node, "
                "SkyPilot's own included; rlx stops only the cluster it started",
            )
        elif re.search(r"\bray\s+start\b", command):
            yield lr.finding(
                ("setup", i),
                WARNING,
                "rlx starts and joins the Ray cluster "
                "itself; a 'ray start' in setup will clash with it",
            )


def check_checkpoint_storage(lr: LoadedRecipe) -> Iterator[Finding]:
    recipe, trainer = lr.recipe, lr.recipe.trainer
    if trainer is None:
        return
    ckpt = trainer.checkpoint
    retries = _retries_on(recipe)
    if ckpt.dir is None:
        if retries:
            yield lr.finding(
                ("trainer", "checkpoint", "dir"),
                ERROR,
                f"{retries} restarts the job, but without checkpoint.dir it starts "
                "over from step 0; set checkpoint.dir on a volume",
            )
        if ("trainer", "checkpoint", "resume") in lr.positions.lines and ckpt.resume == "auto":
            yield lr.finding(
                ("trainer", "checkpoint", "resume"),
                ERROR,
                "resume: auto needs checkpoint.dir to look in; set it",
            )
        return
    if _under(ckpt.dir, _shared_roots(recipe, writable=True)):
        return
    reasons = []
    if recipe.resources.nodes > 1:
        reasons.append(f"{recipe.resources.nodes} nodes write shards there")
    if retries:
        reasons.append(f"{retries} may restart the job on another machine")
    if reasons:
        yield lr.finding(
            ("trainer", "checkpoint", "dir"),
            ERROR,
            f"{ckpt.dir} is on node-local disk but {' and '.join(reasons)}; put it "
            "under a volume path (volumes:) or a bucket mount",
        )


def check_resume_path(lr: LoadedRecipe) -> Iterator[Finding]:
    trainer = lr.recipe.trainer
    if trainer is None or trainer.checkpoint.resume in ("auto", "never"):
        return
    readable = _shared_roots(lr.recipe, writable=False)
    if lr.recipe.resources.nodes > 1 and not _under(trainer.checkpoint.resume, readable):
        yield lr.finding(
            ("trainer", "checkpoint", "resume"),
            ERROR,
            "every node loads the checkpoint to resume from, but this path is not on shared "
            "storage; put it under a volume or a file mount",
        )


def check_shared_model_and_data(lr: LoadedRecipe) -> Iterator[Finding]:
    recipe, trainer = lr.recipe, lr.recipe.trainer
    if trainer is None or recipe.resources.nodes == 1:
        return
    readable = _shared_roots(recipe, writable=False)
    models = [("model", trainer.model.path)]
    if trainer.critic_model:
        models.append(("critic_model", trainer.critic_model.path))
    for field, path in models:
        if path.startswith(("/", "~")) and not _under(path, readable):
            yield lr.finding(
                ("trainer", field, "path"),
                ERROR,
                f"{path} is read on every node but is not on shared storage; put it "
                "under a volume, a file mount, or the workdir (relative path)",
            )
    data = trainer.data.train
    if data.startswith(("/", "~")) and not _under(data, readable):
        yield lr.finding(
            ("trainer", "data", "train"),
            WARNING,
            f"{data} is read on the head only, which a restarted job may not land "
            "on; keep data on a volume or in the workdir",
        )


def check_volumes_for_backends(lr: LoadedRecipe) -> Iterator[Finding]:
    recipe = lr.recipe
    cloud_backends = [b for b in ("sky", "dstack") if getattr(recipe, b) is not None]
    for i, volume in enumerate(recipe.volumes):
        if volume.name is None and cloud_backends:
            yield lr.finding(
                ("volumes", i, "path"),
                ERROR,
                f"{volume.path} has no volume name, so "
                f"{' and '.join(cloud_backends)} cannot attach it; add 'name:'",
            )
    for target in recipe.file_mounts:
        if not target.startswith(("/", "~")):
            yield lr.finding(
                ("file_mounts", target),
                ERROR,
                f"mount point {target!r} must be absolute (or start with ~)",
            )


def check_slurm(lr: LoadedRecipe) -> Iterator[Finding]:
    recipe, slurm = lr.recipe, lr.recipe.slurm
    if slurm is None:
        return
    if recipe.file_mounts:
        yield lr.finding(
            ("file_mounts",),
            ERROR,
            "Slurm copies no files to the nodes; put them "
            "on the shared filesystem and list that path under volumes",
        )
    if recipe.resources.image and not slurm.container:
        yield lr.finding(
            ("resources", "image"),
            WARNING,
            "Slurm ignores resources.image; set slurm.container to run in a container",
        )
    container = slurm.container
    image = container.image if container and container.runtime == "pyxis" else None
    if image and "#" not in image and re.match(r"^[a-z0-9.-]+\.[a-z]+(:[0-9]+)?/", image):
        registry, _, rest = image.partition("/")
        yield lr.finding(
            ("slurm", "container", "image"),
            WARNING,
            f"pyxis separates the registry with '#': write '{registry}#{rest}'",
        )
    if container and container.runtime in ("docker", "podman"):
        yield lr.finding(
            ("slurm", "container", "runtime"),
            WARNING,
            f"{container.runtime} containers run outside Slurm's cgroups: the job's CPU and "
            "memory limits do not hold inside them; prefer pyxis or apptainer where the site "
            "has them",
        )
    if recipe.resources.spot:
        yield lr.finding(
            ("resources", "spot"), WARNING, "Slurm has no spot instances; spot is ignored there"
        )


def check_sky(lr: LoadedRecipe) -> Iterator[Finding]:
    recipe, sky = lr.recipe, lr.recipe.sky
    if sky is None:
        return
    infra = (sky.infra or "").lower()
    if recipe.resources.spot and infra.startswith(("k8s", "kubernetes", "ssh")):
        yield lr.finding(
            ("resources", "spot"),
            ERROR,
            f"{sky.infra} has no spot instances; set spot: false or pick a cloud",
        )


def check_dstack(lr: LoadedRecipe) -> Iterator[Finding]:
    recipe, dstack = lr.recipe, lr.recipe.dstack
    if dstack is None:
        return
    if recipe.resources.nodes > 1 and not dstack.fleets:
        yield lr.finding(
            ("dstack", "fleets"),
            WARNING,
            "a distributed task needs a fleet with placement: cluster; name it "
            "here so the run does not wait for one that never fits",
        )
    for name, value in recipe.env.items():
        if "\n" in value or "\r" in value:
            yield lr.finding(
                ("env", name),
                ERROR,
                "dstack cannot pass a value with a line "
                "break; put it in a file in the workdir instead",
            )
    for target, source in recipe.file_mounts.items():
        if is_bucket(source):
            yield lr.finding(
                ("file_mounts", target),
                WARNING,
                "dstack copies local files only; this bucket is not mounted there",
            )


def check_checkpoint_cadence(lr: LoadedRecipe) -> Iterator[Finding]:
    trainer = lr.recipe.trainer
    if trainer and trainer.checkpoint.dir and trainer.checkpoint.every > trainer.steps:
        yield lr.finding(
            ("trainer", "checkpoint", "every"),
            WARNING,
            f"every {trainer.checkpoint.every} steps but the run has "
            f"{trainer.steps}; only the final checkpoint will be written",
        )


def check_unused_settings(lr: LoadedRecipe) -> Iterator[Finding]:
    trainer = lr.recipe.trainer
    if trainer is None:
        return
    if trainer.algorithm != "ppo" and trainer.critic_model is not None:
        yield lr.finding(
            ("trainer", "critic_model"),
            WARNING,
            f"{trainer.algorithm} has no critic; critic_model is ignored",
        )
    if lr.recipe.command is not None:
        yield lr.finding(
            ("command",),
            WARNING,
            "command replaces rlx's trainer, so the trainer section is only "
            "passed along (as RLX_RECIPE_JSON)",
        )


CHECKS: list[Check] = [
    check_has_work,
    check_batch_divisibility,
    check_tensor_parallel,
    check_rollout_engine,
    check_group_size,
    check_layout,
    check_colocated_tensor_parallel,
    check_trainer_specs,
    check_memory_plan,
    check_ray_ports,
    check_public_ports,
    check_dashboard_host,
    check_auth,
    check_debugger,
    check_secrets_in_env,
    check_reserved_env,
    check_setup_commands,
    check_checkpoint_storage,
    check_resume_path,
    check_shared_model_and_data,
    check_volumes_for_backends,
    check_slurm,
    check_sky,
    check_dstack,
    check_checkpoint_cadence,
    check_unused_settings,
]


def lint_loaded(lr: LoadedRecipe) -> list[Finding]:
    findings = [f for check in CHECKS for f in check(lr)]
    return sorted(findings, key=lambda f: (f.line, f.field, f.message))


def lint_file(path: str | Path) -> list[Finding]:
    """Every finding for one recipe file: schema errors, or else the semantic checks."""
    try:
        loaded = load_recipe(path)
    except RecipeError as exc:
        return exc.findings
    except RlxError as exc:
        return [Finding(str(path), 1, ERROR, "(recipe)", str(exc).split(": ", 1)[-1])]
    return lint_loaded(loaded)


def recipe_files(paths: Iterable[str | Path]) -> list[Path]:
    """Expand folders into their *.yaml / *.yml files (recursively, sorted)."""
    out: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            out.extend(sorted(p for p in path.rglob("*") if p.suffix in (".yaml", ".yml")))
        elif path.exists():
            out.append(path)
        else:
            raise RlxError(f"{path}: no such file or folder")
    return out
