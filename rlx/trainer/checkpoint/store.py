"""Atomic, resumable checkpoints: <root>/<run id>/step-000050/, one folder per saved step.

A save writes every part into a hidden temporary sibling (.step-000050.tmp-<random>): the
small parts as single files, the sharded training state as a torch.distributed.checkpoint
folder to which every rank writes its own shard. One process then fsyncs each file and the
folder, renames it into place, and only then writes the COMPLETE marker
(itself written to a temporary name, fsynced and renamed) and fsyncs the parent. A folder
without the marker is an interrupted save: it is never resumed from and the next save removes
it, together with stale temporary folders. Older checkpoints are rotated out only once the
new one is complete, so a save killed at any point leaves the previous checkpoint resumable.

One save into a run folder at a time: the controller picks the temporary folder (begin),
the ranks fill it, rank 0 commits it.
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
import shutil
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from rlx import __version__
from rlx.checkpoints import MARKER, MARKER_FORMAT, STEP_DIR, parse_marker, step_name, step_of
from rlx.errors import RlxError
from rlx.trainer.checkpoint.base import CheckpointBase
from rlx.trainer.checkpoint.best import rotated_out
from rlx.trainer.checkpoint.parts import (
    fsync_path,
    read_part,
    sha256_of,
    write_part,
    write_synced,
)
from rlx.trainer.checkpoint.protocol import PhaseHook, SavedCheckpoint

# Leftovers of interrupted saves (.tmp-) and of rotations (.old-); both are safe to delete.
LEFTOVER_DIR = re.compile(r"\.step-[0-9]{6,}\.(tmp|old)-[0-9a-f]+")
PART_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}")
RESERVED_PART_NAMES = frozenset({"step", MARKER})

# Files up to this size get a sha256 in the marker (the small parts); shards only a size.
HASHED_BYTES = 64 << 20

RUN_ID_CHARS = re.compile(r"[^A-Za-z0-9_.-]+")
MAX_RUN_ID_LENGTH = 128


def sanitize_run_id(raw: str) -> str:
    """A folder name from an arbitrary id: safe characters only, no leading dot, bounded."""
    cleaned = RUN_ID_CHARS.sub("-", raw.strip()).lstrip(".-")[:MAX_RUN_ID_LENGTH]
    return cleaned.rstrip(".-")


def read_marker(folder: Path) -> dict[str, Any] | None:
    """The COMPLETE marker of a checkpoint folder, or None when the folder is not complete."""
    folder = Path(folder)
    try:
        text = (folder / MARKER).read_bytes()
    except OSError:
        return None
    return parse_marker(text, step_of(folder.name))


def newest_complete(run_dir: Path) -> Path | None:
    complete = complete_checkpoints(run_dir)
    return complete[-1][1] if complete else None


def complete_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint in run_dir, oldest step first."""
    if not run_dir.is_dir():
        return []
    found = []
    for child in run_dir.iterdir():
        match = STEP_DIR.fullmatch(child.name)
        if match and child.is_dir() and read_marker(child) is not None:
            found.append((int(match["step"]), child))
    return sorted(found)


def check_part_name(name: str) -> None:
    if not PART_NAME.fullmatch(name) or name in RESERVED_PART_NAMES:
        raise ValueError(
            f"checkpoint part name {name!r} must match {PART_NAME.pattern} "
            f"and not be one of {sorted(RESERVED_PART_NAMES)}"
        )


def describe_files(folder: Path, prefix: str = "", *, sync: bool = False) -> list[dict[str, Any]]:
    """Every file under folder by its name in the checkpoint (prefix/relative name): its
    size, and for files up to HASHED_BYTES its sha256. Shards are not hashed: reading back
    every rank's shard on one process would cost as much as the save. sync: fsync each file
    and folder first (and folder itself)."""
    files = []
    for path in sorted(folder.rglob("*")):
        if sync:
            fsync_path(path)
        if path.is_dir():
            continue
        name = path.relative_to(folder).as_posix()
        entry: dict[str, Any] = {
            "name": f"{prefix}/{name}" if prefix else name,
            "bytes": path.stat().st_size,
        }
        if entry["bytes"] <= HASHED_BYTES:
            entry["sha256"] = sha256_of(path)
        files.append(entry)
    if sync:
        fsync_path(folder)
    return files


def new_marker(
    step: int, entries: Mapping[str, Mapping[str, str]], files: list[dict[str, Any]]
) -> dict[str, Any]:
    """The COMPLETE marker of step: its parts (file and format) and every file it holds."""
    return {
        "format": MARKER_FORMAT,
        "step": step,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "unix_time": time.time(),
        "rlx_version": __version__,
        "bytes": sum(file["bytes"] for file in files),
        "parts": dict(entries),
        "files": files,
    }


def write_parts(
    folder: Path, parts: Mapping[str, Any], _after_phase: PhaseHook | None = None
) -> dict[str, dict[str, str]]:
    """Write each part into folder as one file (see CheckpointManager.save); returns the
    entries a commit records."""
    hook = _after_phase or (lambda phase: None)
    for name in parts:
        check_part_name(name)
    folder.mkdir(parents=True, exist_ok=True)
    entries = {}
    for name, value in parts.items():
        entries[name] = write_part(folder, name, value)
        hook(f"part:{name}")
    return entries


def load_folder_parts(path: Path, names: Iterable[str]) -> dict[str, Any]:
    """The named parts of the complete checkpoint in folder path (those it has), each file
    checked against the size (and for small files the digest) its COMPLETE marker recorded;
    plus "step". A DCP part comes back as its folder's path."""
    marker = read_marker(path)
    if marker is None:
        raise RlxError(f"{path} is not a complete checkpoint (no valid COMPLETE marker)")
    out: dict[str, Any] = {}
    for name in names:
        entry = marker["parts"].get(name)
        if entry is None:
            continue
        verify_files(path, marker["files"], (entry["file"],))
        out[name] = read_part(path, entry)
    out["step"] = marker["step"]
    return out


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size if path.is_file() else None
    except OSError:
        return None


def size_problem(files: list[dict[str, Any]], size_of: Any) -> str | None:
    """The first of a marker's files whose size (size_of(name): bytes, or None when it is
    missing) differs from the one recorded, as a few words; None when all match."""
    for file in files:
        found = size_of(file["name"])
        if found is None:
            return f"{file['name']} is missing"
        if found != file["bytes"]:
            return f"{file['name']} has {found} of its {file['bytes']} bytes"
    return None


def verify_files(path: Path, files: list[dict[str, Any]], prefixes: tuple[str, ...] = ()) -> None:
    """Check the marker's files (those under prefixes, when given) against their recorded
    size and digest, so damage is reported as such instead of failing inside a loader."""
    for file in files:
        name = file["name"]
        if prefixes and not any(name == p or name.startswith(f"{p}/") for p in prefixes):
            continue
        target = path / name
        if not target.is_file() or target.stat().st_size != file["bytes"]:
            raise RlxError(f"checkpoint {path}: {name} is missing or truncated")
        if "sha256" in file and sha256_of(target) != file["sha256"]:
            raise RlxError(f"checkpoint {path}: {name} does not match its checksum")


# --------------------------------------------------------------------------- the manager


class CheckpointManager(CheckpointBase):
    """Saves, finds and loads the checkpoints of one run under root/run_id/ (a folder every
    rank shares); follows protocol.Checkpoints."""

    background = False  # a save is complete when the ranks return

    def __init__(self, root: Path, run_id: str, keep: int):
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        if sanitize_run_id(run_id) != run_id or not run_id:
            raise ValueError(f"run id {run_id!r} is not a safe folder name; see resolve_run_id")
        self.root = Path(root)
        self.run_id = run_id
        self.keep = keep

    @property
    def run_dir(self) -> Path:
        return self.root / self.run_id

    def checkpoints(self) -> list[Path]:
        """Every complete checkpoint of this run, oldest step first."""
        return [path for _, path in complete_checkpoints(self.run_dir)]

    def latest(self) -> Path | None:
        """The complete checkpoint with the highest step, or None."""
        return newest_complete(self.run_dir)

    def location(self, step: int) -> Path:
        return self.run_dir / step_name(step)

    def problem(self, location: Path | str) -> str | None:
        path = Path(location)
        marker = read_marker(path)
        if marker is None:
            return f"no valid {MARKER} marker"
        return size_problem(marker["files"], lambda name: _size(path / name))

    def save(
        self,
        step: int,
        parts: Mapping[str, Any],
        *,
        best_step: int | None = None,
        _after_phase: PhaseHook | None = None,
    ) -> Path:
        """Write parts as the checkpoint of step, atomically, and return its folder.

        Each part becomes one file: a non-empty flat dict of str -> tensor goes to safetensors,
        a value JSON stores unchanged (str-keyed dicts, lists, numbers, strings) to JSON so it
        can be read by eye, anything else through torch.save (checked first to load back with
        weights_only=True). A complete checkpoint of the same step is replaced; complete
        checkpoints of later steps are removed once this one is complete, since a run saving
        step N has abandoned whatever came after N (it was resumed from an earlier step);
        best_step (checkpoint.best's) is never rotated out.

        _after_phase is for crash tests: called with "part:<name>" after each part file,
        "written" once the temporary folder is synced, "renamed" once it is in place,
        "marked" once the marker is durable, and "rotated" at the end.
        """
        temporary = self.begin(step)
        try:
            entries = self.write_parts(temporary, parts, _after_phase)
        except BaseException:
            shutil.rmtree(temporary, ignore_errors=True)
            raise
        return self.commit(temporary, step, entries, best_step=best_step, _after_phase=_after_phase)

    def begin(self, step: int) -> Path:
        """A fresh temporary folder for step's checkpoint, after clearing what interrupted
        saves left. Several processes may write into it (each rank its own shard files);
        one then calls commit."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        self.root.mkdir(parents=True, exist_ok=True)
        if not self.run_dir.is_dir():
            self.run_dir.mkdir(exist_ok=True)
            fsync_path(self.root)
        self._remove_leftovers()
        return self._fresh_sibling(self.run_dir / f"step-{step:06d}", "tmp")

    def write_parts(
        self, folder: Path, parts: Mapping[str, Any], _after_phase: PhaseHook | None = None
    ) -> dict[str, dict[str, str]]:
        """Write each part into folder (see save); returns the entries commit records."""
        return write_parts(folder, parts, _after_phase)

    def commit(
        self,
        temporary: Path,
        step: int,
        entries: Mapping[str, Mapping[str, str]],
        *,
        best_step: int | None = None,
        _after_phase: PhaseHook | None = None,
    ) -> Path:
        """Make a filled temporary folder step's complete checkpoint: sync it, rename it into
        place, write the COMPLETE marker (every file with its size; small files with their
        sha256 too), then rotate (sparing best_step). entries: each part's file (or folder)
        and format."""
        hook = _after_phase or (lambda phase: None)
        for name in entries:
            check_part_name(name)
        files = describe_files(temporary, sync=True)
        hook("written")

        final = self.location(step)
        replaced = None
        if final.exists():
            # An older save of this step (complete or not): move it aside, drop it below.
            replaced = self._fresh_sibling(final, "old", create=False)
            final.rename(replaced)
        temporary.rename(final)
        fsync_path(self.run_dir)
        hook("renamed")

        marker = new_marker(step, entries, files)
        write_synced(final / f".{MARKER}.tmp", json.dumps(marker, indent=1).encode())
        (final / f".{MARKER}.tmp").rename(final / MARKER)
        fsync_path(final)
        fsync_path(self.run_dir)
        hook("marked")

        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
        self._rotate(step, best_step)
        hook("rotated")
        return final

    # A save of every rank's shard (protocol.Checkpoints): every rank writes into the save's
    # temporary folder itself, on storage they all share; rank 0 commits it.

    def rank_folder(self, folder: Path, rank: int) -> Path:
        return folder

    def save_shard(self, folder: Path, step: int, rank: int, shard: str) -> None:
        """Nothing to do: the shard is in the save's folder already."""

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
        """Rank 0, once every rank has written its shard (DCP's save is collective): commit."""
        final = self.commit(folder, step, entries, best_step=best_step, _after_phase=_after_phase)
        marker = read_marker(final)
        return SavedCheckpoint(str(final), None if marker is None else marker["bytes"])

    def discard(self, folder: Path) -> None:
        """Nothing: a failed save's folder is the controller's to abandon."""

    def abandon(self, step: int, folder: Path) -> None:
        """Remove a failed save's temporary folder, and its step's folder when the save got
        as far as renaming it but not as far as its marker (a full disk frees up at once)."""
        shutil.rmtree(folder, ignore_errors=True)
        final = self.location(step)
        if final.is_dir() and read_marker(final) is None:
            shutil.rmtree(final, ignore_errors=True)

    def load_parts(self, location: Path | str, names: Iterable[str]) -> dict[str, Any]:
        return load_folder_parts(Path(location), names)

    def shard_reader(self, part: Path | str) -> Any:
        """DCP's reader of a DCP part's folder, as load_parts gave it."""
        import torch.distributed.checkpoint as dcp

        return dcp.FileSystemReader(str(part))

    def pinned(self, setting: str) -> Path:
        """The one complete checkpoint a checkpoint.resume path names (RlxError if it is not)."""
        path = Path(setting).expanduser()
        if not path.exists():
            raise RlxError(f"checkpoint.resume: {path} does not exist; give a step-NNNNNN folder")
        if not path.is_dir():
            raise RlxError(f"checkpoint.resume: {path} is not a folder; give a step-NNNNNN folder")
        if read_marker(path) is None:
            newest = newest_complete(path)
            if newest is not None:
                hint = f"it looks like a run folder; did you mean {newest}?"
            else:
                hint = f"it has no valid {MARKER} marker (an interrupted save or not a checkpoint)"
            raise RlxError(f"checkpoint.resume: {path} is not a complete checkpoint: {hint}")
        return path

    def load(self, path: Path, *, verify: bool = True) -> dict[str, Any]:
        """The parts saved in a complete checkpoint, plus "step". Tensors come back on the CPU.

        verify checks every file against the marker's sizes and sha256 digests first, so a
        damaged checkpoint is reported as such instead of failing somewhere inside a loader.
        """
        path = Path(path)
        marker = read_marker(path)
        if marker is None:
            raise RlxError(f"{path} is not a complete checkpoint (no valid {MARKER} marker)")
        if verify:
            verify_files(path, marker["files"])
        loaded: dict[str, Any] = {"step": marker["step"]}
        for name, entry in marker["parts"].items():
            loaded[name] = read_part(path, entry)
        return loaded

    # ----------------------------------------------------------------------- internals

    def _fresh_sibling(self, final: Path, kind: str, *, create: bool = True) -> Path:
        while True:
            candidate = final.with_name(f".{final.name}.{kind}-{secrets.token_hex(4)}")
            if not create:
                if not candidate.exists():
                    return candidate
                continue
            with contextlib.suppress(FileExistsError):
                candidate.mkdir()
                return candidate

    def _remove_leftovers(self) -> None:
        """Delete temporary folders and step folders without a marker (interrupted saves)."""
        for child in self.run_dir.iterdir():
            interrupted = STEP_DIR.fullmatch(child.name) and read_marker(child) is None
            if child.is_dir() and (LEFTOVER_DIR.fullmatch(child.name) or interrupted):
                shutil.rmtree(child, ignore_errors=True)

    def _rotate(self, newest_step: int, best_step: int | None) -> None:
        complete = dict(complete_checkpoints(self.run_dir))
        for step in rotated_out(complete, newest_step, self.keep, best_step):
            path = complete[step]
            # Rename first: a deletion killed halfway must not leave a marker on a partial
            # folder; the renamed leftover is cleared by the next save.
            doomed = self._fresh_sibling(path, "old", create=False)
            path.rename(doomed)
            fsync_path(self.run_dir)
            shutil.rmtree(doomed, ignore_errors=True)
