"""What both checkpoint managers share: a training rank's whole part in a save, told once
over the steps each manager takes its own way (protocol.Checkpoints: rank_folder,
write_parts, save_shard, commit_save, discard)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rlx.trainer.background import Background
from rlx.trainer.checkpoint.faults import save_errors, save_failure
from rlx.trainer.checkpoint.protocol import (
    Checkpoints,
    Finished,
    SavedCheckpoint,
    SaveRequest,
)
from rlx.trainer.checkpoint.training import (
    EXPORT_INFO,
    HF_FILES,
    LEARNER_STATE,
    WORKER_RNG,
    copy_model_files,
    kill_hook_for_save,
    save_learner_state,
)


class CheckpointBase:
    """The save as every training rank runs it, whichever manager holds the checkpoints.
    Subclasses give the steps protocol.Checkpoints states (rank_folder, write_parts,
    save_shard, commit_save, discard) and say whether they finish in the background."""

    def save_rank(
        self: Checkpoints,
        request: SaveRequest,
        rank: int,
        world_size: int,
        *,
        learner_state: Callable[[], dict[str, Any]],
        learner_parts: Callable[[], Mapping[str, Any]],
        dtype: str,
        model_folder: Path,
    ) -> Background | Finished:
        """Write this rank's shard of the save (every rank, together: DCP's save is a
        collective); rank 0 adds the small parts (the learner's, the controller's, every
        rank's RNG, the export dtype) and the model's small files, and commits. result()
        of what comes back gives rank 0 the complete checkpoint, the other ranks None; where
        the manager saves in the background (an upload into object storage) it waits for
        that first. A failure is one line for the controller, never a half-written step."""
        step = request.step
        folder = self.rank_folder(Path(request.folder), rank)
        hook = kill_hook_for_save(request.kill_spec, step) if rank == 0 else None
        entries: dict[str, dict[str, str]] = {}
        try:
            save_learner_state(learner_state(), folder / LEARNER_STATE)
            if rank == 0:
                if hook is not None:
                    hook(f"part:{LEARNER_STATE}")
                parts = {
                    **learner_parts(),
                    **request.controller_parts,
                    WORKER_RNG: {"workers": request.rng_states},
                    EXPORT_INFO: {"dtype": dtype},
                }
                entries = self.write_parts(folder, parts, hook)
                # The policy's folder on this node (a hub id's snapshot): config, tokenizer.
                copy_model_files(model_folder, folder / HF_FILES)
                entries[LEARNER_STATE] = {"file": LEARNER_STATE, "format": "dcp"}
                entries[HF_FILES] = {"file": HF_FILES, "format": "folder"}
        except save_errors() as exc:
            self.discard(folder)
            raise save_failure(exc, step, self.run_dir) from None
        except BaseException:
            self.discard(folder)
            raise

        def finish() -> SavedCheckpoint | None:
            try:
                self.save_shard(folder, step, rank, LEARNER_STATE)
                if rank != 0:
                    return None
                return self.commit_save(
                    folder,
                    step,
                    entries,
                    world_size,
                    LEARNER_STATE,
                    best_step=request.best_step,
                    _after_phase=hook,
                )
            except save_errors() as exc:
                raise save_failure(exc, step, self.run_dir) from None
            finally:
                self.discard(folder)

        return Background(finish) if self.background else Finished(finish())
