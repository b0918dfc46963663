"""A run's checkpoints as both sides read them: the trainer that writes them
(rlx.trainer.checkpoint) and `rlx status` on a machine without torch. One home for the step
folder's name, the COMPLETE marker's name and format, and what makes a marker valid.

    <checkpoint.dir>/<run id>/step-000050/...   a folder, or a prefix in a store
    <checkpoint.dir>/<run id>/step-000050/COMPLETE   written last: the step is complete

Light: no torch; fsspec only when the checkpoints are in a store.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

MARKER = "COMPLETE"
MARKER_FORMAT = 1
STEP_DIR = re.compile(r"step-(?P<step>[0-9]{6,})")


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def step_of(name: str) -> int | None:
    """The step a step folder's name (its last path part) stands for, else None."""
    match = STEP_DIR.fullmatch(name.rstrip("/").rsplit("/", 1)[-1])
    return None if match is None else int(match["step"])


def parse_marker(text: bytes | str, step: int | None) -> dict[str, Any] | None:
    """The marker of step's folder from its text, or None when it does not make the folder a
    complete checkpoint (unreadable, another format, another step)."""
    try:
        marker = json.loads(text)
    except ValueError:
        return None
    if not isinstance(marker, dict) or marker.get("format") != MARKER_FORMAT:
        return None
    if step is None or marker.get("step") != step:
        return None
    return marker


def newest_complete_step(run_checkpoints: Path | str) -> str | None:
    """The newest complete checkpoint (its folder or URL) of one run's checkpoints, wherever
    they are; None when there is none (or the store cannot be read from here)."""
    from rlx.storage import is_store_url, unstrip

    location = str(run_checkpoints).rstrip("/")
    if is_store_url(location):
        try:
            from rlx.storage import filesystem

            fs, base = filesystem(location)
            fs.invalidate_cache(base)
            children = fs.ls(base, detail=False)
        except Exception:  # no library, no credentials, no such prefix: nothing to show
            return None
        read = fs.cat_file

        def shown(child: str) -> str:
            return unstrip(location, child)
    else:
        folder = Path(location)
        if not folder.is_dir():
            return None
        children = [str(p) for p in folder.iterdir() if p.is_dir()]

        def read(path: str) -> bytes:
            return Path(path).read_bytes()

        def shown(child: str) -> str:
            return child

    found = sorted((s, c) for c in children if (s := step_of(c)) is not None)
    for step, child in reversed(found):
        try:
            text = read(f"{child.rstrip('/')}/{MARKER}")
        except OSError:  # FileNotFoundError included: an incomplete step
            continue
        if parse_marker(text, step) is not None:
            return shown(child)
    return None
