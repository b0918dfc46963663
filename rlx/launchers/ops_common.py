"""Small pieces the cloud launchers (sky_ops, dstack_ops) share. No backend imports here."""

from __future__ import annotations

import re
from pathlib import Path

from rlx.launchers.base import LaunchRequest, state_dir

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def one_line(error: BaseException | str) -> str:
    """The first non-empty line of an error's text, without terminal colour codes: backends
    put hints on later lines and colour commands, and rlx prints exactly one line."""
    text = _ANSI.sub("", str(error))
    for line in text.splitlines():
        if line.strip():
            return line.strip().rstrip(".")
    return type(error).__name__ if isinstance(error, BaseException) else ""


def save_rendered(request: LaunchRequest, suffix: str) -> Path:
    """Keep the submitted file next to the job registry (names of secrets only, no values)."""
    folder = state_dir(request.workdir) / "rendered"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{request.name}{suffix}"
    path.write_text(request.rendered, encoding="utf-8")
    return path


def absolute_local(path: str, workdir: Path) -> str:
    """Relative local paths in a recipe (workdir, file mounts) are relative to where
    `rlx launch` runs, whatever folder the backend's client resolves them from."""
    local = Path(path).expanduser()
    return str(local if local.is_absolute() else (workdir / local).resolve())
