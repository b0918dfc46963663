"""Small pieces the backends' operations (each package's ops.py) share: the error table, the
one-line error, where rendered files are kept, local paths. No backend library is imported
here."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Generic, TypeVar

from rlx.errors import RlxError
from rlx.launchers.base import LaunchRequest, state_dir

Target = TypeVar("Target")

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def one_line(error: BaseException | str) -> str:
    """The first non-empty line of an error's text, without terminal colour codes: backends
    put hints on later lines and colour commands, and rlx prints exactly one line."""
    text = _ANSI.sub("", str(error))
    for line in text.splitlines():
        if line.strip():
            return line.strip().rstrip(".")
    return type(error).__name__ if isinstance(error, BaseException) else ""


Explain = Callable[[BaseException, Target], str]  # (the library's error, target) -> one line


class ErrorTable(Generic[Target]):
    """A backend library's exceptions as one line each, what happened and what to do next.

    `lines` is keyed by the exception's module and class name (`sky.exceptions.ClusterNotUpError`),
    so a table is built without importing the library; an error takes the line of its class or
    of its nearest base class there, else `fallback`'s. `target` is what the operation was about
    (a cluster, a run, a job), for the line."""

    def __init__(self, lines: Mapping[str, Explain[Target]], fallback: Explain[Target]):
        self.lines = dict(lines)
        self.fallback = fallback

    def explain(self, exc: BaseException, target: Target) -> str:
        for klass in type(exc).__mro__:
            handler = self.lines.get(f"{klass.__module__}.{klass.__name__}")
            if handler is not None:
                return handler(exc, target)
        return self.fallback(exc, target)

    @contextmanager
    def around(self, target: Target) -> Iterator[None]:
        """The library's exception out of the block becomes RlxError with its one line;
        rlx's own errors and Ctrl-C pass as they are."""
        try:
            yield
        except (RlxError, KeyboardInterrupt):
            raise
        except Exception as exc:
            raise RlxError(self.explain(exc, target)) from exc


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
