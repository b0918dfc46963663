"""rlx ships itself: `rlx launch` sends a wheel of the running rlx with the job, and every
node installs exactly that version before `rlx node` when its own differs.

The wheel is built here from the package's own files (no build tool, no network): its
version is rlx's plus a local label with the hash of those files (`0.1.0+g1a2b3c4d5e`), so
two different checkouts never pass for each other. The node side is a few lines of shell in
the rendered run block (see `common.INSTALL_SHIPPED`), and `rlx node` checks the result
(rlx/node/version.py).
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import os
import zipfile
from collections.abc import Mapping
from pathlib import Path

# The rendered run block imports shipped_version from here (rlx.launchers.ship): the name
# stays importable at this path for the nodes of jobs rendered by any rlx version.
from rlx.node.version import package_files, shipped_version


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
    files = package_files()
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
    # A name of this process's own: two launches building the same wheel at once never
    # write into one file; the rename puts a complete wheel in place either way.
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as wheel:
        for name, data in [*entries, (f"{info}/RECORD", record.encode())]:
            wheel.writestr(zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0)), data)
    partial.replace(path)
    return path
