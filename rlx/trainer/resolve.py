"""Turn the recipe's trainer section into concrete things: a run id and folders, model folders,
a prompt file, a reward function. Runs on the head before any worker starts, so a bad path or
spec fails in a second with one line instead of inside a Ray actor.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlx import hub
from rlx.errors import RlxError, first_line
from rlx.hub import is_hub_id
from rlx.recipe.model import TrainerSettings
from rlx.recipe.specs import (
    HUB_DATA_PREFIX,
    SYNTHETIC_PREFIX,
    SYNTHETIC_TASKS,
    TINY_PREFIX,
    TinyModel,
    is_local_path,
    synthetic_task_problem,
    tiny_model,
    tiny_spec_problem,
)
from rlx.runs import RunPaths
from rlx.storage import check_url, is_store_url, join
from rlx.trainer.checkpoint import resolve_run_id
from rlx.trainer.checkpoint.remote import staging_root
from rlx.trainer.tasks.data import HubSource, hub_source
from rlx.trainer.tasks.rewards import RewardFn, resolve_reward

SYNTHETIC_ROWS = 1024
MODEL_CACHE = ".models"  # under checkpoint.dir: a name no run id can take (leading dot)
DATA_FOLDER = "data"


def run_paths(name: str, settings: TrainerSettings, env: Mapping[str, str]) -> RunPaths:
    """The run id of recipe `name` (stable across relaunches, see resolve_run_id) and the
    run's folders."""
    check_path_fields(settings)
    run_id = resolve_run_id(name, env)
    log_dir = settings.logging.dir
    if is_store_url(log_dir):
        # Written on this node's disk, mirrored to the store (runs.py: push_run).
        run_dir = staging_root() / "runs" / run_id
        run_url: str | None = join(log_dir, run_id)
    else:
        run_dir = Path(log_dir).expanduser().absolute() / run_id
        run_url = None
    ckpt = settings.checkpoint.dir
    root: Path | str | None
    if ckpt is None:
        root = None
    elif is_store_url(ckpt):
        root = ckpt.rstrip("/")
    else:
        root = Path(ckpt).expanduser().absolute()
    return RunPaths(run_id, run_dir, root, run_url)


def check_path_fields(settings: TrainerSettings) -> None:
    """Every path field that holds a URL names a store rlx can use here (its extra is
    installed): one line otherwise, before anything is written."""
    fields = {
        "checkpoint.dir": settings.checkpoint.dir,
        "logging.dir": settings.logging.dir,
        "model.path": settings.model.path,
        "critic_model.path": settings.critic_model and settings.critic_model.path,
    }
    if not settings.data.train.startswith(HUB_DATA_PREFIX):  # a hub dataset, not a store
        fields["data.train"] = settings.data.train
    if settings.checkpoint.resume not in ("auto", "never"):
        fields["checkpoint.resume"] = settings.checkpoint.resume
    for field, value in fields.items():
        if value:
            check_url(value, field)
    if is_store_url(settings.data.train):
        raise RlxError(
            f"trainer.data.train: {settings.data.train} is in a store; the prompt file is read "
            "on the head only, so keep it in the workdir (or on a volume), or fetch it in setup:"
        )


# --------------------------------------------------------------------------- models


def model_cache_dir(paths: RunPaths) -> Path:
    """Where generated models go: beside the checkpoints (shared storage on multi-node jobs,
    lint makes sure of it); with checkpoints in a store, each node's staging folder (every
    node builds its own copy, node_model_path); else inside the run folder."""
    if isinstance(paths.checkpoint_root, str):
        return staging_root() / "models"
    if paths.checkpoint_root is not None:
        return paths.checkpoint_root / MODEL_CACHE
    return paths.run_dir / "models"


def resolve_model_path(spec: str, cache_dir: Path, seed: int, field: str = "model") -> str:
    """The local folder of a model: as given, a hub id's snapshot in this node's hub cache
    (rlx.hub: fetched unless HF_HUB_OFFLINE), a store URL's copy, or for `tiny:...` the
    random model built once (the same spec and seed give the same bytes) into cache_dir."""
    if spec.startswith(TINY_PREFIX):
        problem = tiny_spec_problem(spec)
        model = tiny_model(spec)
        if problem is not None or model is None:
            raise RlxError(f"trainer.{field}.path: {spec!r} {problem}")
        return str(build_tiny_cached(model, cache_dir, seed))
    if is_store_url(spec):
        return str(fetch_model(spec, field))
    if is_hub_id(spec):
        return str(hub.snapshot(spec, field=f"trainer.{field}.path"))
    if is_local_path(spec) or Path(spec).is_dir():
        folder = Path(spec).expanduser()
        if not folder.is_dir():
            raise RlxError(
                f"trainer.{field}.path: {spec} is not a folder; give a local model folder "
                "(config.json and weights) or a Hugging Face hub id such as Qwen/Qwen2.5-0.5B"
            )
        if not (folder / "config.json").is_file():
            raise RlxError(
                f"trainer.{field}.path: {spec} has no config.json; point it at a folder "
                "saved with save_pretrained"
            )
        return str(folder.absolute())  # the workers may start elsewhere
    raise RlxError(f"trainer.{field}.path: {spec!r} is neither a folder nor a hub id")


def fetch_model(url: str, field: str = "model", where: str | None = None) -> Path:
    """A model folder in a store, downloaded once per node into its staging folder (to a
    scratch name, renamed when whole): every node reads its own copy. where: the recipe
    field its errors name (trainer.<field>.path unless given)."""
    from rlx.storage import filesystem
    from rlx.trainer.checkpoint.store import sanitize_run_id

    target = staging_root() / "models" / sanitize_run_id(url.replace("://", "-"))
    if (target / "config.json").is_file():
        return target
    fs, base = filesystem(url)
    if not fs.exists(f"{base}/config.json"):
        raise RlxError(
            f"{where or f'trainer.{field}.path'}: {url} has no config.json; point it at the "
            "prefix of a model saved with save_pretrained (or uploaded by rlx export)"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        names = [p[len(base) + 1 :] for p in fs.find(base)]
        for name in names:
            (scratch / name).parent.mkdir(parents=True, exist_ok=True)
        fs.get([f"{base}/{n}" for n in names], [str(scratch / n) for n in names])
        with contextlib.suppress(OSError):  # another process won the race: use theirs
            os.rename(scratch, target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def node_model_path(resolved: str, source: str, seed: int, field: str = "model") -> str:
    """The head's resolved model path as a folder on this node: a hub id's snapshot at the
    commit the head resolved, in this node's cache (fetched once per node); a model in a
    store fetched here too; a tiny model built here when the head's cache is not shared."""
    if is_hub_id(source):
        commit = hub.commit_of(resolved)
        return str(hub.snapshot(source, revision=commit, field=f"trainer.{field}.path"))
    if is_store_url(source):
        return str(fetch_model(source))
    model = tiny_model(source) if source.startswith(TINY_PREFIX) else None
    if model is not None and not Path(resolved).is_dir():
        return str(build_tiny_cached(model, Path(resolved).parent, seed))
    return resolved


def build_tiny_cached(model: TinyModel, cache_dir: Path, seed: int) -> Path:
    """The folder of a tiny model (built once per spec and seed, then reused)."""
    from rlx.trainer.model.tiny import build_tiny_model

    target = cache_dir / f"tiny-{model.name}-seed{seed}"
    if (target / "config.json").is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: a concurrent builder (or a crash) never leaves a
    # half-written folder at the name others load from.
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=cache_dir))
    try:
        build_tiny_model(
            scratch,
            arch=model.arch,
            hidden_size=model.hidden,
            num_layers=model.layers,
            num_heads=model.heads,
            embedding_std=model.embed_std,
            seed=seed,
        )
        with contextlib.suppress(OSError):  # another process won the race: use theirs
            os.rename(scratch, target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def load_tokenizer(path: str, trust_remote_code: bool) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        first = first_line(exc)
        raise RlxError(
            f"trainer.model.path: cannot load a tokenizer from {path!r}: {first}"
        ) from None


# --------------------------------------------------------------------------- data and reward


def resolve_data_path(
    spec: str,
    run_dir: Path,
    seed: int,
    field: str = "data.train",
    held_out: bool = False,
    config: str | None = None,
    split: str = "train",
) -> Path | HubSource:
    """The prompt file: as given, `synthetic:NAME` generated into the run folder (the
    same name and seed give the same rows; held_out: the task's held-out rows), or an
    `hf://` dataset's split (config, split) in this node's hub cache at the commit this
    process resolved (fetched once, under the node's lock, as models are)."""
    if spec.startswith(HUB_DATA_PREFIX):
        source = hub_source(spec, config, split, field=f"trainer.{field}")
        assert source is not None  # fetch=True: found or RlxError
        return source
    if spec.startswith(SYNTHETIC_PREFIX):
        problem = synthetic_task_problem(spec)
        if problem is not None:
            raise RlxError(f"trainer.{field}: {problem}")
        name = spec.removeprefix(SYNTHETIC_PREFIX)
        suffix = "-held-out" if held_out else ""
        target = run_dir / DATA_FOLDER / f"{name}-seed{seed}{suffix}.jsonl"
        if not target.is_file():
            scratch = target.with_name(f".{target.name}.tmp-{os.getpid()}")
            module, _, function = SYNTHETIC_TASKS[name].partition(":")
            write = getattr(importlib.import_module(module), function)
            write(scratch, SYNTHETIC_ROWS, seed=seed, held_out=held_out)
            os.replace(scratch, target)
        return target
    path = Path(spec).expanduser()
    if not path.is_file():
        raise RlxError(
            f"trainer.{field}: {spec} does not exist; give a .jsonl or .parquet file, or "
            "synthetic:letters_or_digits"
        )
    return path


def resolve_reward_fn(settings: TrainerSettings) -> RewardFn:
    spec = settings.reward.function
    if spec == "gsm8k" and settings.reward.gsm8k_mode == "flexible":
        spec = "gsm8k_flexible"
    return resolve_reward(spec)
