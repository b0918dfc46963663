"""What `rlx launch --dry-run` prints for the local backend: the run it would start here. Pure:
the run folder's date and time are shown as placeholders."""

from __future__ import annotations

from rlx.errors import RlxError
from rlx.launchers.local import BACKEND
from rlx.recipe import Recipe
from rlx.storage import join

# This machine is one node: running both groups on it would hide what the recipe asks for.
NO_GROUPS = (
    "resources.groups asks for training and rollout machines of their own, and the local "
    "backend is this one machine; launch with --backend sky, dstack or slurm, or drop groups "
    "(set resources.nodes and accelerators) to run here"
)


NO_PRICES = (
    "resources.max_hourly_cost: the local backend is this machine, which has no price to cap; "
    "launch with --backend sky or dstack, or drop max_hourly_cost to run here"
)


NO_IDLE_LIMIT = (
    "resources.idle_minutes: the local backend keeps nothing up once the run ends (its Ray "
    "ends with it), so there is no idle limit to keep; drop it, or launch with --backend sky, "
    "dstack or slurm --keep"
)


def refuse_elsewhere(recipe: Recipe) -> None:
    if recipe.resources.groups is not None:
        raise RlxError(NO_GROUPS)
    # An idle limit asked for by name promises a cluster that ends on its own: none here.
    if "idle_minutes" in recipe.resources.model_fields_set:
        raise RlxError(NO_IDLE_LIMIT)
    # Accelerators (alternatives too), spot and places mean nothing here and are ignored;
    # a price cap is refused, as it would promise a limit that nothing here keeps.
    if recipe.resources.max_hourly_cost is not None:
        raise RlxError(NO_PRICES)


def render(recipe: Recipe, source: str) -> str:
    """What `rlx launch --dry-run` prints for the local backend."""
    refuse_elsewhere(recipe)
    trainer = recipe.trainer
    lines = [
        f"# rlx launch {source}: local backend (this machine, a private Ray)",
        f"# {BACKEND.stays_up}",
    ]
    if trainer is None or recipe.command is not None:
        command = " && ".join(recipe.head_command)
        lines.append(f"would run on this machine, with a Ray head started for it: {command}")
        return "\n".join(lines) + "\n"
    # storage.join, not Path: a store URL keeps its two slashes (gs://bucket, not gs:/bucket)
    run_dir = join(trainer.logging.dir, f"{recipe.name}-<date>-<time>")
    ckpt = trainer.checkpoint
    rollout, batch = trainer.rollout, trainer.batch
    rows = [
        ("algorithm", trainer.algorithm),
        ("model", f"{trainer.model.path} ({trainer.model.dtype})"),
        ("data", trainer.data.train),
        ("reward", trainer.reward.function),
        (
            "rollout",
            f"{rollout.engine}, {rollout.n} per prompt, <= {rollout.max_new_tokens} tokens",
        ),
        ("steps", f"{trainer.steps} x {batch.prompts_per_step} prompts (seed {trainer.seed})"),
        ("run folder", f"{run_dir} (metrics.jsonl, train.log, reward.png)"),
        (
            "checkpoints",
            "off (checkpoint.dir unset)"
            if ckpt.dir is None
            else f"{join(ckpt.dir, '<run id>')} every {ckpt.every} steps, keep {ckpt.keep}",
        ),
    ]
    width = max(len(key) for key, _ in rows)
    lines += [f"{key.ljust(width)}  {value}" for key, value in rows]
    lines.append("set RLX_RUN_ID to an earlier run's id to continue it")
    return "\n".join(lines) + "\n"
