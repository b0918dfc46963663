"""What a run's checkpoints look like to the code that saves and loads them, whichever holds
them: a folder (store.py) or a prefix in an object store (remote.py). Store-or-local is
decided once, when the manager is opened (resume.open_manager); everything after calls the
manager it is handed."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from rlx.trainer.background import Background

Location = Path | str  # a checkpoint's folder, or its URL in a store
PhaseHook = Callable[[str], None]  # told each phase of a save as it ends (crash tests)


@dataclass(frozen=True)
class SavedCheckpoint:
    """What rank 0 answers to a SaveRequest: the complete checkpoint, its size on disk and
    the transient store errors every rank retried on the way."""

    path: str
    bytes: int | None
    retries: int = 0


class Checkpoints(Protocol):
    """One run's checkpoints under root/run_id/: found, saved and loaded. Two kinds follow
    it, a folder (store.CheckpointManager) and a prefix in an object store
    (remote.StoreCheckpointManager); resume.open_manager picks one from checkpoint.dir, once,
    and the controller and every training rank call the one they are handed.

    A save: the controller picks its temporary folder (begin) and hands it to every training
    rank with this manager (SaveRequest, below). Each rank calls save_rank, which both
    managers share (base.CheckpointBase): the rank writes its shard under the folder the
    manager gives it (rank_folder), rank 0 the small parts too (write_parts); then each rank
    calls save_shard, rank 0 commit_save, which makes the checkpoint complete, and every rank
    discard. Where `background` is set, those three run in a thread of each rank while
    training goes on (a store's upload)."""

    run_id: str
    keep: int
    background: bool  # save_shard and commit_save go on after the ranks have returned

    @property
    def run_dir(self) -> Location:
        """Where this run's checkpoints are."""
        ...

    def checkpoints(self) -> Sequence[Location]:
        """Every complete checkpoint of this run, oldest step first."""
        ...

    def latest(self) -> Location | None:
        """The complete checkpoint with the highest step, or None."""
        ...

    def problem(self, location: Location) -> str | None:
        """What is wrong with the complete checkpoint at location (a file its marker lists
        that is missing or shorter or longer than recorded), read from sizes alone; None
        when every file is there."""
        ...

    def location(self, step: int) -> Location:
        """Where step's checkpoint is once it is complete."""
        ...

    def begin(self, step: int) -> Path:
        """The controller's first move of a save: clear what interrupted saves left and
        pick the save's temporary folder."""
        ...

    def save_rank(
        self,
        request: SaveRequest,
        rank: int,
        world_size: int,
        *,
        learner_state: Callable[[], dict[str, Any]],
        learner_parts: Callable[[], Mapping[str, Any]],
        dtype: str,
        model_folder: Path,
    ) -> Background | Finished:
        """A training rank's whole part in a save (base.CheckpointBase.save_rank)."""
        ...

    def rank_folder(self, folder: Path, rank: int) -> Path:
        """Where rank writes its share of the save whose temporary folder is `folder`."""
        ...

    def write_parts(
        self, folder: Path, parts: Mapping[str, Any], _after_phase: PhaseHook | None = None
    ) -> dict[str, dict[str, str]]:
        """Rank 0: each small part as one file in folder; returns the entries commit_save
        records."""
        ...

    def save_shard(self, folder: Path, step: int, rank: int, shard: str) -> None:
        """Rank `rank` has written its files of part `shard` (a DCP folder) under folder:
        make them part of step's checkpoint."""
        ...

    def commit_save(
        self,
        folder: Path,
        step: int,
        entries: Mapping[str, Mapping[str, str]],
        world_size: int,
        shard: str,
        best_step: int | None = None,
        _after_phase: PhaseHook | None = None,
    ) -> SavedCheckpoint:
        """Rank 0, after its own save_shard: once all world_size ranks' shards are in, make
        step's checkpoint complete (the COMPLETE marker last) and rotate older ones out
        (best.rotated_out: never best_step, checkpoint.best's step)."""
        ...

    def discard(self, folder: Path) -> None:
        """A rank's part of a save is over (done or failed): what only it needed goes."""
        ...

    def abandon(self, step: int, folder: Path) -> None:
        """The controller, after step's save failed: remove what it left (its temporary
        folder, an unmarked step), so neither a later save nor a resume meets it; best
        effort, the next begin clears what remains."""
        ...

    def load_parts(self, location: Location, names: Iterable[str]) -> dict[str, Any]:
        """The named parts of the complete checkpoint at location (those it has), each
        checked against its marker, plus "step". A DCP part comes back as where it lies (a
        folder, or its URL in a store, read in place)."""
        ...

    def shard_reader(self, part: Location) -> Any:
        """DCP's storage reader of a DCP part where load_parts says it lies."""
        ...

    def pinned(self, setting: str) -> Location:
        """The one complete checkpoint a checkpoint.resume path names, checked (RlxError,
        what to give instead, when it is not one)."""
        ...


class Finished:
    """A save that was over when its ranks returned: result() gives what it gave."""

    def __init__(self, value: SavedCheckpoint | None):
        self._value = value

    def result(self) -> SavedCheckpoint | None:
        return self._value


@dataclass(frozen=True)
class SaveRequest:
    """One checkpoint save, as every training rank receives it from the controller (one
    object across Ray): each rank writes its shard where `manager` puts it for `folder`;
    rank 0 adds the small parts and commits the save as step `step` of the manager's run."""

    folder: str  # the save's temporary folder (a store: named like each node's staging folder)
    manager: Checkpoints  # the run's checkpoints, as the controller opened them
    step: int
    controller_parts: dict[str, Any]  # the controller's own parts (trainer state, RNG)
    rng_states: list[dict[str, Any]]  # every rank's RNG state, in rank order
    kill_spec: str | None = None  # KILL_HOOK_ENV as the controller read it (tests)
    best_step: int | None = None  # checkpoint.best's step after this save: never rotated out
