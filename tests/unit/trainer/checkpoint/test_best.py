"""checkpoint.best: the best validated step is never rotated out, by a folder's manager or a
store's (one rule, best.rotated_out), and a resumed run knows it again."""

from __future__ import annotations

import io
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from rlx.checkpoints import step_of
from rlx.recipe.model import TrainerSettings
from rlx.runs import RunPaths
from rlx.trainer.checkpoint.best import Best, beats, consider, restored, rotated_out
from rlx.trainer.checkpoint.protocol import SavedCheckpoint
from rlx.trainer.checkpoint.remote import StoreCheckpointManager
from rlx.trainer.checkpoint.store import CheckpointManager
from rlx.trainer.checkpoint.training import LEARNER_STATE
from tests.support.recipes import trainer_section


def test_the_rule_keeps_the_newest_and_the_best() -> None:
    assert rotated_out([2, 4, 6], newest=6, keep=1, best=None) == [2, 4]
    assert rotated_out([2, 4, 6], newest=6, keep=1, best=2) == [4]
    assert rotated_out([6, 2, 4], newest=6, keep=2, best=6) == [2]  # best among the newest
    assert rotated_out([2, 4, 6, 8], newest=4, keep=1, best=2) == [6, 8]  # abandoned: after 4
    assert rotated_out([2], newest=2, keep=1, best=None) == []


def test_the_best_moves_only_for_a_better_value_of_a_validated_step() -> None:
    top = SimpleNamespace(metric="val/avg@4", mode="max")
    low = SimpleNamespace(metric="val/response_length", mode="min")
    best = consider(None, top, 2, {"val/avg@4": 0.5})
    assert best == Best("val/avg@4", "max", 2, 0.5)
    assert consider(best, top, 4, {"val/avg@4": 0.5}) is best  # a tie keeps the earlier
    assert consider(best, top, 4, {"val/avg@4": 0.7}).step == 4
    assert consider(best, top, 4, None) is best  # not validated at step 4
    assert consider(best, top, 4, {"val/avg@4": math.nan}) is best
    assert consider(best, None, 4, {"val/avg@4": 0.9}) is best  # checkpoint.best unset
    shortest = consider(None, low, 2, {"val/response_length": 30.0})
    assert consider(shortest, low, 4, {"val/response_length": 20.0}).step == 4
    assert not beats(40.0, shortest, "min")


def test_a_best_ranked_another_way_starts_afresh_with_a_line() -> None:
    saved = Best("val/avg@4", "max", 2, 0.5).to_json()
    setting = SimpleNamespace(metric="val/avg@4", mode="max")
    assert restored(saved, setting) == (Best("val/avg@4", "max", 2, 0.5), None)
    best, note = restored(saved, SimpleNamespace(metric="val/pass@1", mode="max"))
    assert best is None and note is not None and "starts afresh" in note and "\n" not in note
    assert restored(None, setting) == (None, None)
    assert restored(saved, None) == (None, None)


def test_a_folder_keeps_the_best_step_beside_the_newest(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, "run", keep=1)
    for step in (2, 4, 6):
        manager.save(step, {"meta": {"step": step}}, best_step=2)
    assert [step_of(p.name) for p in manager.checkpoints()] == [2, 6]
    manager.save(8, {"meta": {}}, best_step=8)  # a new best: the old one may go
    assert [step_of(p.name) for p in manager.checkpoints()] == [8]


def test_a_store_rotates_by_the_same_rule() -> None:
    """The store's own rotation (its listing and deletes stood in for: no server here)."""
    manager = StoreCheckpointManager.__new__(StoreCheckpointManager)
    manager.keep = 1
    deleted: list[int] = []
    manager._listing = lambda: {2: True, 4: True, 5: False, 6: True}  # type: ignore[method-assign]
    manager._delete = deleted.append  # type: ignore[method-assign]
    manager._rotate(6, 2)
    assert deleted == [4]  # 5 is incomplete: begin clears it, rotation only counts complete


# --------------------------------------------------------------------------- the trainer


class _Ranks:
    """What the controller asks of the training ranks in a save and a resume, done here: rank
    0 writes the small parts and commits as save_rank does (no learner shard, a stand-in)."""

    plan = SimpleNamespace(train_workers=1)
    last_tolerance = 0.0
    engine_dtype = "float32"

    def call_all(self, method: str, *args: Any) -> list[Any]:
        if method == "rng_state":
            return [{}]
        if method == "save_checkpoint":
            (request,) = args
            manager, folder = request.manager, Path(request.folder)
            parts = {**request.controller_parts, LEARNER_STATE: {"stand_in": True}}
            entries = manager.write_parts(folder, parts)
            final = manager.commit(folder, request.step, entries, best_step=request.best_step)
            return [SavedCheckpoint(str(final), 1)]
        if method == "load_checkpoint":
            return [SimpleNamespace(host_bytes=0, rng_restored=True)]
        raise AssertionError(method)

    def sync_weights(self, step: int, probe: Any, push: bool = True) -> float:
        return 0.0


PROMPTS = "hf://org/prompts"


def _trainer(tmp_path: Path, commit: str = "a" * 40) -> Any:
    from rlx.trainer.checkpoint import open_manager
    from rlx.trainer.loop import Trainer

    settings = TrainerSettings.model_validate(
        trainer_section(
            tmp_path,
            steps=10,
            validation={"data": "synthetic:letters_or_digits", "every": 2, "n": 4},
            checkpoint={
                "dir": str(tmp_path / "ckpt"),
                "every": 2,
                "keep": 1,
                "best": {"metric": "val/avg@4", "mode": "max"},
            },
        )
    )
    paths = RunPaths("run", tmp_path / "runs" / "run", tmp_path / "ckpt")
    trainer = Trainer.__new__(Trainer)
    trainer.settings = settings
    trainer.cluster = _Ranks()
    data = SimpleNamespace(revisions={PROMPTS: commit})  # the dataset's commit read now
    trainer.inputs = SimpleNamespace(paths=paths, probe=None, data=data)
    trainer.manager = open_manager(tmp_path / "ckpt", "run", settings.checkpoint.keep)
    trainer.out, trainer.err = io.StringIO(), io.StringIO()
    trainer.clock = SimpleNamespace(phase_of=lambda phase: _Nothing())
    trainer.uploading, trainer.newest_saved = None, None
    trainer.checkpoint_bytes, trainer.saves_retried = None, 0
    trainer.best, trainer.best_pending, trainer.validated = None, None, None
    trainer.sampler = SimpleNamespace(load_state_dict=lambda state: None)
    trainer.queue = SimpleNamespace(sampler_state_after=lambda step: {"step": step})
    trainer.backfill = None
    return trainer


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _steps(trainer: Any) -> list[int | None]:
    return [step_of(str(p)) for p in trainer.manager.checkpoints()]


def test_the_best_step_survives_rotation_and_resume(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path)
    for step, value in ((2, 0.5), (4, 0.2), (6, 0.3)):
        trainer.validated = (step, {"val/avg@4": value})
        trainer.save(step)
    assert _steps(trainer) == [2, 6]  # keep 1, and the best beside it
    assert trainer.best == Best("val/avg@4", "max", 2, 0.5)
    assert trainer.best_record()["checkpoint"] == str(tmp_path / "ckpt" / "run" / "step-000002")
    assert "best checkpoint: val/avg@4 0.5 at step 2 (max)" in trainer.out.getvalue()

    resumed = _trainer(tmp_path)  # a new process: it knows the best from step 6's state
    assert resumed.resume() == 6
    assert resumed.best == Best("val/avg@4", "max", 2, 0.5)
    assert "best checkpoint so far: val/avg@4 0.5 at step 2" in resumed.out.getvalue()
    resumed.save(7)  # a save that was not validated (a stop that saves first) is no candidate
    assert _steps(resumed) == [2, 7] and resumed.best.step == 2
    resumed.validated = (8, {"val/avg@4": 0.9})
    resumed.save(8)
    assert _steps(resumed) == [8] and resumed.best == Best("val/avg@4", "max", 8, 0.9)


def test_a_failed_save_does_not_make_its_step_the_best(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path)
    trainer.validated = (2, {"val/avg@4": 0.5})
    trainer.save(2)
    trainer.validated = (4, {"val/avg@4": 0.9})
    trainer.best_pending = (4, Best("val/avg@4", "max", 4, 0.9))  # as _save leaves it ...
    trainer.saved(SavedCheckpoint(str(tmp_path / "elsewhere" / "step-000003"), 1))  # ... not 4
    assert trainer.best is not None and trainer.best.step == 2


def test_the_record_is_none_until_a_validated_step_is_saved(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path)
    trainer.save(2)
    assert trainer.best is None and trainer.best_record() is None


def test_a_resume_where_the_dataset_moved_on_is_refused(tmp_path: Path) -> None:
    """A save records the dataset's commit; a resume that reads another stops in one line
    (the integration test: test_train_cli, a dataset repository that moved on)."""
    from rlx.errors import RlxError

    _trainer(tmp_path).save(2)
    with pytest.raises(RlxError, match=f"cannot resume from .*{PROMPTS} at commit aaaaaaaaaaaa"):
        _trainer(tmp_path, commit="b" * 40).resume()
    assert _trainer(tmp_path).resume() == 2  # the same commit goes on
