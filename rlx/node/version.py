"""Which rlx a node runs: the hash of rlx's own files, the version a shipped wheel carries.

`rlx launch` ships a wheel of the running rlx whose version is rlx's plus a local label with
this hash (`0.1.0+g1a2b3c4d5e`), so two different checkouts never pass for each other; the run
block installs it on a node whose rlx differs, and `rlx node` checks the result here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path

import rlx
from rlx import __version__
from rlx.errors import RlxError
from rlx.node.env import WHEEL_ENV

SKIP_DIRS = {"__pycache__"}
SKIP_SUFFIXES = {".pyc", ".pyo"}


def package_files() -> list[tuple[str, bytes]]:
    root = Path(rlx.__file__).parent
    files = []
    for path in sorted(root.rglob("*")):
        if not path.is_file() or path.suffix in SKIP_SUFFIXES:
            continue
        if SKIP_DIRS & set(path.relative_to(root).parts):
            continue
        files.append((f"rlx/{path.relative_to(root).as_posix()}", path.read_bytes()))
    return files


def shipped_version(files: list[tuple[str, bytes]] | None = None) -> str:
    digest = hashlib.sha256()
    for name, data in files if files is not None else package_files():
        digest.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    return f"{__version__.split('+')[0]}+g{digest.hexdigest()[:10]}"


def wheel_version(wheel: str) -> str:
    """The version in a wheel's file name (rlx-VERSION-py3-none-any.whl)."""
    return Path(wheel).name.split("-")[1]


def check_node_version(env: Mapping[str, str]) -> None:
    """On a node of a job that shipped rlx: the rlx running here must be that one."""
    wheel = env.get(WHEEL_ENV, "")
    if not wheel:
        return
    want = wheel_version(wheel)
    have = shipped_version()  # the hash of the files this node runs, as the wheel's is
    if have != want:
        raise RlxError(
            f"this node runs rlx {have}, the job was launched with rlx {want}; the shipped "
            f"wheel ({wheel}) did not install: see the lines above in this node's log"
        )
