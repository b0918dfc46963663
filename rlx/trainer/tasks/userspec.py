"""Import what a recipe names as `package.module:name` or `path/to/file.py:name`.

Rewards and environments are both named this way; this is the one place such a spec is
imported, so both give the same one-line errors (what spec, which file or module, what to do).
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import Any


def spec_problem(
    spec: str, kind: str, builtins: Iterable[str], owner: str, name: str
) -> str | None:
    """What is wrong with a spec's form, before anything is imported: None when it names a
    built-in or looks like `target:name`. owner, name: how the help says what the spec may
    name ("a user function", "function"; "a class", "Class")."""
    if spec in builtins:
        return None
    forms = f"'package.module:{name}' or 'path/to/file.py:{name}'"
    if ":" not in spec:
        return (
            f"unknown {kind} {spec!r}; valid: {', '.join(sorted(builtins))}, or {owner} as {forms}"
        )
    target, _, attribute = spec.rpartition(":")
    if not target or not attribute.isidentifier():
        return f"bad {kind} spec {spec!r}; expected a built-in name, {forms}"
    return None


def import_target(spec: str, kind: str, error: type[Exception]) -> tuple[ModuleType, str]:
    """The module a `target:name` spec points at, and the name; errors are `error(...)` lines
    that start with `{kind} {spec!r}:`. User code is imported only here, only when called."""
    target, _, name = spec.rpartition(":")
    if target.endswith(".py"):
        return _module_from_file(Path(target), spec, kind, error), name
    try:
        return importlib.import_module(target), name
    except ImportError as exc:
        raise error(
            f"{kind} {spec!r}: cannot import module {target!r} ({exc}); is it installed or on "
            "PYTHONPATH? A file path must end in .py"
        ) from exc


def missing_name(module: ModuleType, spec: str, kind: str, what: str, keep: Any) -> str:
    """The line for a module without the spec's name, listing the module's public `what`
    (the values `keep(value)` accepts)."""
    target, _, name = spec.rpartition(":")
    public = sorted(n for n, v in vars(module).items() if keep(v) and n[0] != "_")
    return (
        f"{kind} {spec!r}: {target!r} has no attribute {name!r}; its {what}: "
        f"{', '.join(public) or '(none)'}"
    )


def _module_from_file(path: Path, spec: str, kind: str, error: type[Exception]) -> ModuleType:
    if not path.is_file():
        raise error(
            f"{kind} {spec!r}: file {str(path)!r} does not exist (paths are relative to the "
            "folder the job runs in)"
        )
    # A name derived from the whole path keeps two files with the same stem apart.
    module_name = f"rlx_{kind}_" + re.sub(r"\W", "_", str(path.resolve()))
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise error(f"{kind} {spec!r}: cannot load {str(path)!r} as Python")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        raise error(
            f"{kind} {spec!r}: importing {str(path)!r} failed: {type(exc).__name__}: {exc}"
        ) from exc
    return module
