"""Checkpoints in object storage (s3://, gs://, az://): the same folders as on a disk,
<root>/<run id>/step-000050/..., made complete by a COMPLETE marker written last.

Object stores have no atomic rename (a "rename" copies every object), so nothing here renames.
A save goes:

1. on the training step's path: every rank writes its DCP shard into a folder on its own
   node's disk (staging: the node's disks are fast and private; the store is shared and
   slower), and rank 0 writes the small parts there too;
2. off it, in a thread of each rank while training goes on: the rank uploads its own shard
   files to the step's prefix (never another rank's) and then a receipt naming them and
   their sizes under the prefix's .ranks/;
3. rank 0's thread waits for every rank's receipt (the store is the rendezvous: no
   collective runs beside the training step's), uploads the DCP metadata (after the shards:
   metadata names every shard) and the small parts, lists the prefix once to check every
   file is there with its size (S3, GCS and Azure list what was written, strongly
   consistent), removes the receipts and only then writes COMPLETE.

The next save (and the end of the run, and a stop that saves first) waits for the upload
before it begins, so at most one save is in flight and a staged copy never waits on disk for
long. A prefix without the marker is an interrupted save: never loaded, and deleted by the
next save. Retention deletes a checkpoint's marker first, then its files, so a deletion
killed halfway leaves a prefix without a marker (cleaned up later), never a marker over
missing files. Loading reads the marker, downloads the small parts it asks for (checked
against their sha256), and hands DCP the step's URL: every rank reads only the byte ranges
its own shards need (torch's fsspec reader), at any rank count.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from rlx.checkpoints import MARKER, STEP_DIR, parse_marker, step_of
from rlx.errors import RlxError
from rlx.node.raynode import backoff
from rlx.storage import Retries, filesystem, join, storage_options, unstrip
from rlx.trainer.checkpoint.base import CheckpointBase
from rlx.trainer.checkpoint.best import rotated_out
from rlx.trainer.checkpoint.parts import read_part
from rlx.trainer.checkpoint.protocol import PhaseHook, SavedCheckpoint
from rlx.trainer.checkpoint.store import (
    check_part_name,
    describe_files,
    new_marker,
    sanitize_run_id,
    size_problem,
    write_parts,
)

# Node-local folders where ranks stage their shards before the upload (and small parts are
# downloaded to on load); removed once a save or load is done.
STAGING_ENV = "RLX_STAGING_DIR"
DCP_METADATA = ".metadata"
RECEIPTS = ".ranks"  # under a step prefix: one receipt per rank's finished upload
# How long rank 0 waits for the other ranks' receipts: the slowest shard upload of a save.
UPLOAD_WAIT_SECONDS = 3600.0


def staging_root() -> Path:
    return Path(os.environ.get(STAGING_ENV) or Path(tempfile.gettempdir()) / "rlx-staging")


class StoreCheckpointManager(CheckpointBase):
    """Saves, finds and loads the checkpoints of one run under root/run_id/ in a store;
    follows protocol.Checkpoints."""

    background = True  # the ranks upload in threads of their own while training goes on

    def __init__(self, root: str, run_id: str, keep: int):
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        if sanitize_run_id(run_id) != run_id or not run_id:
            raise ValueError(f"run id {run_id!r} is not a safe folder name; see resolve_run_id")
        self.root = root.rstrip("/")
        self.run_id = run_id
        self.keep = keep
        self.fs, self._root_path = filesystem(self.root, retried=True)
        self.retries = Retries.from_env()  # this process's, counted per manager
        self.last_bytes: int | None = None  # the size of the last checkpoint committed
        self.peer_retries = 0  # the other ranks', from their receipts of the last commit

    def __reduce__(self) -> tuple[Any, ...]:
        # Sent to the training ranks as what it is opened from: each rank opens the store
        # with what its own node has (credentials from its environment or cloud identity).
        return (type(self), (self.root, self.run_id, self.keep))

    @property
    def run_dir(self) -> str:
        return join(self.root, self.run_id)

    def step_url(self, step: int) -> str:
        return join(self.run_dir, f"step-{step:06d}")

    def location(self, step: int) -> str:
        return self.step_url(step)

    def problem(self, location: Path | str) -> str | None:
        url = str(location).rstrip("/")
        base = self._path(url)
        marker = self.retries.call(f"reading {url}", read_store_marker, self.fs, base)
        if marker is None:
            return f"no valid {MARKER} marker"
        self.fs.invalidate_cache(base)
        found = self.retries.call(f"listing {url}", self.fs.find, base, detail=True)
        listed = {path[len(base) + 1 :]: info.get("size") for path, info in found.items()}
        return size_problem(marker["files"], listed.get)

    def _path(self, url: str) -> str:
        return self.fs._strip_protocol(url)

    # ------------------------------------------------------------------ finding

    def _listing(self) -> dict[int, bool]:
        """step -> whether it is complete, for every step prefix of this run."""
        return self.retries.call(f"listing {self.run_dir}", self._list_once)

    def _list_once(self) -> dict[int, bool]:
        base = self._path(self.run_dir)
        self.fs.invalidate_cache(base)
        try:
            children = self.fs.ls(base, detail=False)
        except FileNotFoundError:
            return {}
        steps: dict[int, bool] = {}
        for child in children:
            match = STEP_DIR.fullmatch(child.rstrip("/").rsplit("/", 1)[-1])
            if match:
                step = int(match["step"])
                steps[step] = read_store_marker(self.fs, child, step) is not None
        return steps

    def checkpoints(self) -> list[str]:
        """Every complete checkpoint of this run, oldest step first."""
        return [self.step_url(step) for step, done in sorted(self._listing().items()) if done]

    def latest(self) -> str | None:
        found = self.checkpoints()
        return found[-1] if found else None

    # ------------------------------------------------------------------ saving

    def begin(self, step: int) -> Path:
        """The node-local staging folder of step's save, after deleting what interrupted saves
        left in the store (prefixes without a marker) and any older save of this very step.
        The same path on every node names each node's own disk."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        for old, complete in self._listing().items():
            if not complete or old == step:
                self._delete(old)
        staging = staging_root() / self.run_id / f"step-{step:06d}-{os.getpid()}-{time.time_ns()}"
        return staging

    def upload(self, local: Path, step: int, prefix: str, *, skip: tuple[str, ...] = ()) -> list:
        """Upload every file under local to the step's prefix/ (names kept); returns their
        descriptions (relative to the checkpoint)."""
        files = [
            f for f in describe_files(local, prefix) if f["name"].rsplit("/", 1)[-1] not in skip
        ]
        self._put(local, prefix, [f["name"] for f in files], step)
        return files

    def _put(self, local: Path, prefix: str, names: list[str], step: int) -> None:
        if not names:
            return
        base = self._path(self.step_url(step))
        sources = [
            str(local / name[len(prefix) + 1 :] if prefix else local / name) for name in names
        ]
        targets = [f"{base}/{name}" for name in names]
        # Each file is written whole or not at all (a multi-part upload completes last), so
        # putting them all again after a reset is safe.
        self.retries.call(f"uploading to {self.step_url(step)}", self.fs.put, sources, targets)

    def report_upload(self, step: int, rank: int, files: list[dict[str, Any]]) -> None:
        """Say in the store that rank's shard files (files: their descriptions) are in."""
        receipt = f"{self._path(self.step_url(step))}/{RECEIPTS}/rank-{rank:05d}.json"
        text = json.dumps({"files": files, "retries": self.retries.count}).encode()
        self.retries.call(f"writing {receipt}", self.fs.pipe, receipt, text)

    def wait_for_uploads(
        self, step: int, world_size: int, timeout: float = UPLOAD_WAIT_SECONDS
    ) -> list[dict[str, Any]]:
        """Every rank's uploaded files, once all world_size receipts are in the store."""
        folder = f"{self._path(self.step_url(step))}/{RECEIPTS}"
        deadline = time.monotonic() + timeout
        for delay in backoff(start=0.02):
            receipts = self.retries.call(f"listing {folder}", self._receipts, folder)
            if len(receipts) >= world_size:
                break
            if time.monotonic() >= deadline:
                raise RlxError(
                    f"checkpoint {self.step_url(step)}: {world_size - len(receipts)} of "
                    f"{world_size} ranks did not finish their upload within {timeout:.0f} s; "
                    "the save is left incomplete (no COMPLETE marker) and the previous "
                    "checkpoint stays"
                )
            time.sleep(delay)
        read = [json.loads(self.retries.call("reading", self.fs.cat_file, r)) for r in receipts]
        # Rank 0's own receipt holds what self.retries counts already.
        own = f"/rank-{0:05d}.json"
        self.peer_retries = sum(
            receipt["retries"]
            for name, receipt in zip(receipts, read, strict=True)
            if not name.endswith(own)
        )
        return [f for receipt in read for f in receipt["files"]]

    def _receipts(self, folder: str) -> list[str]:
        self.fs.invalidate_cache(folder)
        try:
            return sorted(self.fs.ls(folder, detail=False))
        except FileNotFoundError:
            return []

    def write_parts(
        self, folder: Path, parts: Mapping[str, Any], _after_phase: PhaseHook | None = None
    ) -> dict[str, dict[str, str]]:
        return write_parts(folder, parts, _after_phase)

    def commit(
        self,
        staging: Path,
        step: int,
        entries: Mapping[str, Mapping[str, str]],
        uploaded: list[dict[str, Any]],
        *,
        late: tuple[str, ...] = (),
        best_step: int | None = None,
        _after_phase: PhaseHook | None = None,
    ) -> str:
        """Rank 0's part of a save: upload what staging holds that is not uploaded yet (late:
        files to send after everything else but the marker, such as DCP's metadata), check
        the store lists every file with its size, write COMPLETE, rotate (sparing
        best_step). uploaded: what the ranks have put in the store already."""
        hook = _after_phase or (lambda phase: None)
        for name in entries:
            check_part_name(name)
        done = {f["name"] for f in uploaded}
        local = [f for f in describe_files(staging) if f["name"] not in done]
        first = [f for f in local if f["name"] not in late]
        last = [f for f in local if f["name"] in late]
        self._put(staging, "", [f["name"] for f in first], step)
        self._put(staging, "", [f["name"] for f in last], step)
        files = sorted([*uploaded, *local], key=lambda f: f["name"])
        self.retries.call(f"listing {self.step_url(step)}", self._check_listed, step, files)
        self._remove(f"{self._path(self.step_url(step))}/{RECEIPTS}", recursive=True)
        hook("written")

        marker = new_marker(step, entries, files)
        self.retries.call(
            f"writing {self.step_url(step)}/{MARKER}",
            self.fs.pipe,
            f"{self._path(self.step_url(step))}/{MARKER}",
            json.dumps(marker, indent=1).encode(),
        )
        self.last_bytes = marker["bytes"]
        hook("marked")
        self._rotate(step, best_step)
        hook("rotated")
        return self.step_url(step)

    # A save of every rank's shard (protocol.Checkpoints), in the steps the module's
    # docstring gives: staged on each node's disk, uploaded in a thread of each rank.

    def rank_folder(self, folder: Path, rank: int) -> Path:
        """This rank's staging folder on its node's disk (RLX_STAGING_DIR as the node has
        it), named like the one the controller picked for the save."""
        return staging_root() / self.run_id / folder.name / f"rank-{rank}"

    def save_shard(self, folder: Path, step: int, rank: int, shard: str) -> None:
        """Upload this rank's shard files (DCP's metadata waits for rank 0's commit), then
        its receipt."""
        mine = self.upload(folder / shard, step, shard, skip=(DCP_METADATA,))
        self.report_upload(step, rank, mine)

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
        """Rank 0: wait for every rank's receipt, then commit what its staging folder holds
        besides its shard, DCP's metadata last but the marker."""
        url = self.commit(
            folder,
            step,
            entries,
            self.wait_for_uploads(step, world_size),
            late=(f"{shard}/{DCP_METADATA}",),
            best_step=best_step,
            _after_phase=_after_phase,
        )
        return SavedCheckpoint(url, self.last_bytes, self.retries.count + self.peer_retries)

    def discard(self, folder: Path) -> None:
        """Remove the rank's staged copy."""
        remove(folder)
        with contextlib.suppress(OSError):  # the save's folder, once every rank of the node is done
            folder.parent.rmdir()

    def abandon(self, step: int, folder: Path) -> None:
        """Delete the failed save's prefix (it has no marker: the save failed before it), if
        the store answers; the next begin deletes it otherwise. The ranks' staging folders
        went with their discard."""
        with contextlib.suppress(Exception):
            if self._listing().get(step) is False:
                self._delete(step)

    def load_parts(self, location: Path | str, names: Iterable[str]) -> dict[str, Any]:
        return load_store_parts(str(location), names)

    def shard_reader(self, part: Path | str) -> Any:
        """DCP's reader of a DCP part's URL, read in place (byte ranges through fsspec)."""
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(str(part), **storage_options(str(part)))

    def pinned(self, setting: str) -> str:
        """The one complete checkpoint a checkpoint.resume URL names (RlxError if it is not)."""
        if read_marker_url(setting) is None:
            raise RlxError(
                f"checkpoint.resume: {setting} is not a complete checkpoint (no valid {MARKER} "
                "marker there); give a step-NNNNNN prefix that has one"
            )
        return setting.rstrip("/")

    def _check_listed(self, step: int, files: list[dict[str, Any]]) -> None:
        base = self._path(self.step_url(step))
        self.fs.invalidate_cache(base)
        listed = {
            path[len(base) + 1 :]: info.get("size")
            for path, info in self.fs.find(base, detail=True).items()
        }
        for file in files:
            if listed.get(file["name"]) != file["bytes"]:
                raise RlxError(
                    f"checkpoint {self.step_url(step)}: {file['name']} is not in the store "
                    f"with its {file['bytes']} bytes after the upload; the save is left "
                    "incomplete (no COMPLETE marker) and the previous checkpoint stays"
                )

    # ------------------------------------------------------------------ deleting

    def _delete(self, step: int) -> None:
        """Marker first: a deletion cut short leaves an incomplete prefix, never a marker
        over missing files."""
        base = self._path(self.step_url(step))
        self._remove(f"{base}/{MARKER}")
        self._remove(base, recursive=True)
        self.fs.invalidate_cache(base)

    def _remove(self, path: str, *, recursive: bool = False) -> None:
        """Delete path (already gone: nothing to do), retrying transient errors."""
        with contextlib.suppress(FileNotFoundError):
            self.retries.call(f"deleting {path}", self.fs.rm, path, recursive=recursive)

    def _rotate(self, newest: int, best_step: int | None) -> None:
        complete = [step for step, done in self._listing().items() if done]
        for step in rotated_out(complete, newest, self.keep, best_step):
            self._delete(step)


# --------------------------------------------------------------------------- reading


def read_store_marker(fs: Any, step_path: str, step: int | None = None) -> dict[str, Any] | None:
    """The COMPLETE marker of a step prefix (a path inside fs), or None if not complete."""
    step_path = step_path.rstrip("/")
    try:
        text = fs.cat_file(f"{step_path}/{MARKER}")
    except FileNotFoundError:
        return None
    return parse_marker(text, step_of(step_path) if step is None else step)


def read_marker_url(url: str) -> dict[str, Any] | None:
    fs, path = filesystem(url)
    return read_store_marker(fs, path)


def fetch_files(url: str, names: list[str], marker: Mapping[str, Any], target: Path) -> None:
    """Download the checkpoint's files under each of names (a file or a folder) into target,
    checked against the marker's sizes and digests."""
    from rlx.trainer.checkpoint.store import verify_files

    fs, base = filesystem(url)
    wanted = [
        f
        for f in marker["files"]
        if any(f["name"] == n or f["name"].startswith(f"{n}/") for n in names)
    ]
    if wanted:
        for f in wanted:
            (target / f["name"]).parent.mkdir(parents=True, exist_ok=True)
        try:
            fs.get(
                [f"{base}/{f['name']}" for f in wanted], [str(target / f["name"]) for f in wanted]
            )
        except FileNotFoundError:
            raise RlxError(f"checkpoint {url}: a file its marker lists is missing") from None
    verify_files(target, wanted)


def check_listed(url: str, marker: Mapping[str, Any], prefix: str) -> None:
    """The marker's files under prefix are all in the store with their sizes (a shard too big
    to download just to check is checked by listing)."""
    fs, base = filesystem(url)
    fs.invalidate_cache(base)
    listed = {
        path[len(base) + 1 :]: info.get("size")
        for path, info in fs.find(f"{base}/{prefix}", detail=True).items()
    }
    for f in marker["files"]:
        if f["name"].startswith(f"{prefix}/") and listed.get(f["name"]) != f["bytes"]:
            raise RlxError(f"checkpoint {url}: {f['name']} is missing or truncated in the store")


def load_store_parts(url: str, names: Iterable[str]) -> dict[str, Any]:
    """The named parts of the complete checkpoint at url (those it has), plus "step": the
    small parts are downloaded to a scratch folder, checked and read; DCP parts stay in the
    store (their URL)."""
    marker = read_marker_url(url)
    if marker is None:
        raise RlxError(f"{url} is not a complete checkpoint (no valid COMPLETE marker)")
    out: dict[str, Any] = {}
    scratch = scratch_folder("load")
    try:
        for name in names:
            entry = marker["parts"].get(name)
            if entry is None:
                continue
            if entry["format"] == "dcp":
                check_listed(url, marker, entry["file"])
                out[name] = f"{url.rstrip('/')}/{entry['file']}"
                continue
            if entry["format"] == "folder":
                continue  # hf/: read by export, which fetches it itself
            fetch_files(url, [entry["file"]], marker, scratch)
            out[name] = read_part(scratch, entry)
    finally:
        remove(scratch)
    out["step"] = marker["step"]
    return out


def scratch_folder(kind: str) -> Path:
    folder = staging_root() / f"{kind}-{os.getpid()}-{time.time_ns()}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def remove(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)


__all__ = [
    "StoreCheckpointManager",
    "check_listed",
    "fetch_files",
    "load_store_parts",
    "read_marker_url",
    "read_store_marker",
    "staging_root",
    "unstrip",
]
