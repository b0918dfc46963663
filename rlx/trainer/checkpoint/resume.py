"""Which run a process belongs to, and which checkpoint it starts from."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path

from rlx.errors import RlxError
from rlx.node.env import RUN_ID_ENV
from rlx.storage import is_store_url
from rlx.trainer.checkpoint.protocol import Checkpoints, Location
from rlx.trainer.checkpoint.remote import StoreCheckpointManager
from rlx.trainer.checkpoint.store import (
    CheckpointManager,
    sanitize_run_id,
)

# Where a relaunched job's stable name comes from, first match wins. SLURM_JOB_ID is left
# out on purpose: a resubmitted batch job gets a new id and would not find its checkpoints.
RUN_ID_ENV_VARS = (RUN_ID_ENV, "SKYPILOT_TASK_ID", "DSTACK_RUN_NAME")


def resolve_run_id(recipe_name: str, env: Mapping[str, str]) -> str:
    """A run id that stays the same when a managed job is relaunched, so it finds its checkpoints.

    Order, first non-empty wins: RLX_RUN_ID (explicit choice), SKYPILOT_TASK_ID (stable across
    managed-job recoveries), DSTACK_RUN_NAME (stable across dstack retries), then the recipe
    name, which makes successive Slurm submissions of one recipe continue each other.
    """
    for name in RUN_ID_ENV_VARS:
        run_id = sanitize_run_id(env.get(name, ""))
        if run_id:
            return run_id
    run_id = sanitize_run_id(recipe_name)
    if not run_id:
        raise RlxError(f"cannot make a run id from recipe name {recipe_name!r}; set RLX_RUN_ID")
    return run_id


def open_manager(root: str | Path, run_id: str, keep: int) -> Checkpoints:
    """The manager of run_id's checkpoints under root: a folder, or a store URL. The one
    place that tells the two apart: whoever is handed the manager calls it."""
    if isinstance(root, str) and is_store_url(root):
        return StoreCheckpointManager(root, run_id, keep)
    return CheckpointManager(Path(root), run_id, keep)


def manager_for(checkpoint: str) -> Checkpoints:
    """A manager that reads the one checkpoint named by its folder or URL (checkpoint.resume
    given as a path), of the kind that holds it; its run id and rotation play no part."""
    return open_manager(checkpoint.rstrip("/").rsplit("/", 1)[0], "resume-path", 1)


def location_name(location: Location) -> str:
    """step-NNNNNN of a checkpoint's folder or URL."""
    return str(location).rstrip("/").rsplit("/", 1)[-1]


def resolve_resume(
    setting: str, manager: Checkpoints, note: Callable[[str], None] | None = None
) -> Location | None:
    """The checkpoint to resume from for checkpoint.resume = 'auto' | 'never' | a path.

    'auto': the newest complete checkpoint of this run that verifies (every file its marker
    lists is there with its size), or None for a fresh start; each newer one that does not
    is told to note in one line. 'never': None, but only if this run has no complete
    checkpoint yet: starting over in a folder that holds another history would mix two runs
    (rotation and 'auto' go by step number). A path must be one complete checkpoint that
    verifies; manager is then the one that reads it (manager_for).
    """
    if setting == "auto":
        return newest_verified(manager, note or (lambda line: None))
    if setting == "never":
        newest = manager.latest()
        if newest is not None:
            raise RlxError(
                f"checkpoint.resume: never, but {manager.run_dir} already holds complete "
                f"checkpoints (newest: {location_name(newest)}); set resume: auto to continue "
                "that run, or set RLX_RUN_ID to a new id (or delete that folder) to start afresh"
            )
        return None
    pinned = manager.pinned(setting)
    problem = manager.problem(pinned)
    if problem is not None:
        raise RlxError(
            f"checkpoint.resume: {pinned} fails verification ({problem}); pin an older step, "
            "or set resume: auto to take the newest one that verifies"
        )
    return pinned


def newest_verified(manager: Checkpoints, note: Callable[[str], None]) -> Location | None:
    """The newest complete checkpoint whose files all verify; a line to note for each newer
    one that does not."""
    complete = list(manager.checkpoints())
    failed: list[str] = []
    for location in reversed(complete):
        problem = manager.problem(location)
        if problem is None:
            if failed:
                note(
                    f"checkpoint {failed[0]} fails verification; resuming from "
                    f"{location_name(location)}, the newest complete step that verifies"
                )
            return location
        failed.append(f"{location} ({problem})" if not failed else location_name(location))
        if len(failed) > 1:
            failed = [f"{failed[0]} and {len(failed) - 1} more"]
    if failed:
        raise RlxError(
            f"checkpoint {failed[0]} fails verification, and no older checkpoint of "
            f"{manager.run_dir} verifies; set RLX_RUN_ID to start a new run"
        )
    return None


def moved_data(
    recorded: Mapping[str, str], now: Mapping[str, str], chosen: Collection[str] = ()
) -> str | None:
    """Whether a dataset repository the checkpoint's run trained on (`recorded`: its commit by
    `hf://org/name`) is read at another commit now (`now`): the line that says so, else None.
    A repository the recipe now names by a full commit (`chosen`) was moved on purpose; one
    it no longer names at all was dropped on purpose."""
    for repo, commit in recorded.items():
        current = now.get(repo)
        if current is None or current == commit or repo in chosen:
            continue
        return (
            f"the run started on {repo} at commit {commit[:12]} and it is at {current[:12]} "
            f"now (the dataset changed); write {repo}@{commit} in trainer.data to go on with "
            "the data the run started with, or set RLX_RUN_ID to start a new run"
        )
    return None


def chosen_commits(specs: Iterable[str]) -> set[str]:
    """The dataset repositories `specs` (trainer.data's) name by a full commit."""
    from rlx.hub import COMMIT
    from rlx.recipe.specs import hub_data

    named = [hub_data(spec) for spec in specs]
    return {
        f"hf://{data.repo_id}"
        for data in named
        if data is not None and data.revision is not None and COMMIT.fullmatch(data.revision)
    }
