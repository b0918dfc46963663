"""What a training checkpoint holds, and reading back only the parts a process needs.

Rank 0 of the training workers writes the checkpoint (it holds the weights and optimiser
state, so nothing large crosses the network); the controller hands it the small parts it
owns. Parts:

    policy, optimizer, scheduler                  rank 0's (DDP keeps every rank equal)
    critic, critic_optimizer, critic_scheduler    PPO only
    rng                                           {"workers": [state of rank 0, 1, ...]}
    controller_rng                                the controller's generators
    trainer_state                                 step, sampler position, settings echo (JSON)

Every rank, and the controller, load their parts from the same folder on resume (shared
storage on multi-node jobs).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from rlx.errors import RlxError
from rlx.trainer.checkpoint import read_marker
from rlx.trainer.checkpoint.parts import read_part, sha256_of

LEARNER_PARTS = (
    "policy",
    "optimizer",
    "scheduler",
    "critic",
    "critic_optimizer",
    "critic_scheduler",
)
WORKER_RNG = "rng"
CONTROLLER_RNG = "controller_rng"
TRAINER_STATE = "trainer_state"

# Test hook, read when a step ends or a save starts (never at import): "step:N" kills the
# controller once step N (and its checkpoint) is done; "save:N:PHASE" kills the worker
# writing step N's checkpoint right after PHASE (a CheckpointManager.save phase such as
# "part:optimizer", "written", "renamed"). Used by the resume and crash tests.
KILL_HOOK_ENV = "RLX_TEST_KILL_AT"


def load_parts(path: Path, names: Iterable[str]) -> dict[str, Any]:
    """The named parts of a complete checkpoint (those it has), each file checked against
    the size and digest its COMPLETE marker recorded."""
    marker = read_marker(path)
    if marker is None:
        raise RlxError(f"{path} is not a complete checkpoint (no valid COMPLETE marker)")
    files = {entry["name"]: entry for entry in marker["files"]}
    out: dict[str, Any] = {}
    for name in names:
        entry = marker["parts"].get(name)
        if entry is None:
            continue
        target = path / entry["file"]
        recorded = files.get(entry["file"])
        if recorded is not None:
            if not target.is_file() or target.stat().st_size != recorded["bytes"]:
                raise RlxError(f"checkpoint {path}: {entry['file']} is missing or truncated")
            if sha256_of(target) != recorded["sha256"]:
                raise RlxError(f"checkpoint {path}: {entry['file']} does not match its checksum")
        out[name] = read_part(path, entry)
    out["step"] = marker["step"]
    return out


def kill_hook_for_save(spec: str | None, step: int) -> Callable[[str], None] | None:
    """The CheckpointManager phase hook a 'save:N:PHASE' test spec asks for at this step."""
    if not spec or not spec.startswith("save:"):
        return None
    _, at_step, phase = spec.split(":", 2)
    if int(at_step) != step:
        return None

    def hook(current: str) -> None:
        if current == phase:
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def kill_after_step(spec: str | None, step: int) -> None:
    """Honour a 'step:N' test spec: die at once, as a killed job would."""
    if spec and spec.startswith("step:") and int(spec.split(":", 1)[1]) == step:
        os.kill(os.getpid(), signal.SIGKILL)
