"""Atomic, resumable checkpoints of a training run; see store.py for the on-disk protocol."""

from rlx.trainer.checkpoint.protocol import Checkpoints, PhaseHook
from rlx.trainer.checkpoint.resume import (
    RUN_ID_ENV_VARS,
    location_name,
    manager_for,
    open_manager,
    resolve_resume,
    resolve_run_id,
)
from rlx.trainer.checkpoint.rng import capture_rng_state, restore_rng_state
from rlx.trainer.checkpoint.store import (
    MARKER,
    CheckpointManager,
    read_marker,
    sanitize_run_id,
)

__all__ = [
    "MARKER",
    "RUN_ID_ENV_VARS",
    "CheckpointManager",
    "Checkpoints",
    "PhaseHook",
    "capture_rng_state",
    "location_name",
    "manager_for",
    "open_manager",
    "read_marker",
    "resolve_resume",
    "resolve_run_id",
    "restore_rng_state",
    "sanitize_run_id",
]
