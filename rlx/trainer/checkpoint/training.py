"""What a training checkpoint holds, and reading back only the parts a process needs.

Every training rank writes its own shard of the large state, rank 0 adds the small parts
the controller hands it and commits the folder (store.py's protocol). Parts:

    learner                 folder in torch.distributed.checkpoint (DCP) format: "policy",
                            "optimizer", and for PPO "critic", "critic_optimizer", keyed by
                            the model's parameter names; each rank writes its shard and
                            reads back what its own sharding needs, at any number of ranks
    scheduler               the schedules (identical on every rank)
    critic_scheduler        PPO only
    rng                     {"workers": [state of rank 0, 1, ...]}
    controller_rng          the controller's generators
    trainer_state           step, sampler position, ranks, algorithm (JSON)
    export                  the dtype an export writes (the run's compute dtype)
    hf/                     the policy's config, generation config and tokenizer files, so
                            `rlx export` can write a Hugging Face folder from the checkpoint
                            alone

Every rank, and the controller, load their parts from the same folder on resume (shared
storage on multi-node jobs) or the same URL in an object store (remote.py).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlx.errors import RlxError

LEARNER_STATE = "learner"
# The learner's small parts (Learner.state_parts); LORA_PART records LoRA adapters' base
# and config (lora.adapter_record).
LORA_PART = "lora"
LEARNER_PARTS = ("scheduler", "critic_scheduler", LORA_PART)
WORKER_RNG = "rng"
CONTROLLER_RNG = "controller_rng"
TRAINER_STATE = "trainer_state"
HF_FILES = "hf"
EXPORT_INFO = "export"  # {"dtype": the dtype an export writes: the run's compute dtype}

# What a model folder holds besides its weights: copied into every checkpoint (small).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".ckpt", ".gguf")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")

# Test hook, read when a step ends or a save starts (never at import): "step:N" kills the
# controller once step N (and its checkpoint) is done; "term:N" sends it SIGTERM then;
# "save:N:PHASE" kills the worker writing step N's checkpoint right after PHASE (a
# CheckpointManager.save phase such as "part:optimizer", "written", "renamed"; in a store
# "part:learner" once every shard is uploaded, "written", "marked"). Used by the resume
# and crash tests.
KILL_HOOK_ENV = "RLX_TEST_KILL_AT"


@dataclass(frozen=True)
class LoadReport:
    """What each rank answers when it loads its share of a checkpoint."""

    rng_restored: bool  # its RNG came back too (the checkpoint had as many ranks)
    host_bytes: int  # the host memory the load took at its peak, above what it held before


def copy_model_files(source: Path, target: Path) -> None:
    """The small files of a Hugging Face model folder (config, generation config, tokenizer,
    chat template; not the weights) into target."""
    target.mkdir(parents=True, exist_ok=True)
    for path in sorted(Path(source).iterdir()):
        if not path.is_file() or path.name.startswith("."):
            continue
        if path.name.endswith(WEIGHT_SUFFIXES) or path.name in WEIGHT_INDEXES:
            continue
        shutil.copyfile(path, target / path.name)


def save_learner_state(state: dict[str, Any], folder: Path) -> None:
    """Write this rank's shard of state (collective: every training rank calls it)."""
    import torch.distributed.checkpoint as dcp

    with single_process_quiet():
        dcp.save(
            state,
            storage_writer=dcp.FileSystemWriter(str(folder), sync_files=True),
            no_dist=not distributed(),
        )


def load_learner_state(state: dict[str, Any], folder: Path | str, reader: Any = None) -> None:
    """Fill state in place from a DCP folder: each rank reads only what its tensors (whole,
    or its FSDP shards) cover; DCP reshards when the rank count changed. reader: DCP's
    reader of the part where it lies (the manager's shard_reader: a URL in a store is read
    in place); by default folder is read from disk."""
    import torch.distributed.checkpoint as dcp

    with single_process_quiet():
        if reader is None:
            reader = dcp.FileSystemReader(str(folder))
        try:
            dcp.load(state, storage_reader=reader, no_dist=not distributed())
        except dcp.api.CheckpointException as exc:
            missing = re.search(
                r"Missing key in checkpoint state_dict: ([^\s]+?)\.?$", str(exc), re.M
            )
            if missing is None:
                raise
            raise RlxError(
                f"the checkpoint at {folder} lacks {missing.group(1)}: it was saved by a run "
                "with another model or another trainer.model.lora; set RLX_RUN_ID to start a "
                "new run"
            ) from None


@contextlib.contextmanager
def single_process_quiet() -> Iterator[None]:
    """Silence DCP's warning that it runs without a process group: one rank (or the
    exporter) reading or writing alone is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to .* single")
        yield


def distributed() -> bool:
    """Whether this process is one rank of a process group (else DCP works alone)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


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
    """Honour a 'step:N' test spec: die at once, as a killed job would; 'term:N': send
    ourselves SIGTERM, as a preemption does, once step N is done."""
    if not spec or ":" not in spec:
        return
    kind, _, at = spec.partition(":")
    if kind in ("step", "term") and at.isdigit() and int(at) == step:
        os.kill(os.getpid(), signal.SIGKILL if kind == "step" else signal.SIGTERM)
