"""rlx ships itself: `rlx launch` sends a wheel of the running rlx with the job, and every
node installs exactly that version before `rlx node` when its own differs.

The wheel is built here from the package's own files (no build tool, no network): its
version is rlx's plus a local label with the hash of those files (`0.1.0+g1a2b3c4d5e`), so
two different checkouts never pass for each other. The node side is a few lines of shell in
the rendered run block (see `common.install_shipped`), and `rlx node` checks the result.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import zipfile
from collections.abc import Mapping
from pathlib import Path

import rlx
from rlx import __version__
from rlx.errors import RlxError
from rlx.launchers.common import WHEEL_ENV

SKIP_DIRS = {"__pycache__"}
SKIP_SUFFIXES = {".pyc", ".pyo"}


def _package_files() -> list[tuple[str, bytes]]:
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
    for name, data in files if files is not None else _package_files():
        digest.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    return f"{__version__.split('+')[0]}+g{digest.hexdigest()[:10]}"


def _requirements() -> list[str]:
    try:
        return list(importlib.metadata.requires("rlx") or [])
    except importlib.metadata.PackageNotFoundError:
        return []


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def wheel_dir(env: Mapping[str, str]) -> Path:
    """Where launches keep the wheels they ship: the user's cache, not the project."""
    return Path(env.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "rlx" / "wheels"


def build_wheel(out_dir: Path) -> Path:
    """A wheel of the running rlx in out_dir (reused when one of that version is there)."""
    files = _package_files()
    version = shipped_version(files)
    path = out_dir / f"rlx-{version}-py3-none-any.whl"
    if path.exists():
        return path
    info = f"rlx-{version}.dist-info"
    metadata = "\n".join(
        ["Metadata-Version: 2.1", "Name: rlx", f"Version: {version}"]
        + [f"Requires-Dist: {req}" for req in _requirements()]
    )
    extra = [
        (f"{info}/METADATA", metadata.encode() + b"\n"),
        (
            f"{info}/WHEEL",
            b"Wheel-Version: 1.0\nGenerator: rlx\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        ),
        (f"{info}/entry_points.txt", b"[console_scripts]\nrlx = rlx.cli:main\n"),
    ]
    entries = files + extra
    record = "\n".join(_record_line(n, d) for n, d in entries) + f"\n{info}/RECORD,,\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".tmp")
    with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as wheel:
        for name, data in [*entries, (f"{info}/RECORD", record.encode())]:
            wheel.writestr(zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0)), data)
    partial.replace(path)
    return path


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
