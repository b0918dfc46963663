"""Backends by name. A backend module is imported only when it is chosen, so the CLI stays
fast and a user needs only the libraries of the backends they use."""

from __future__ import annotations

import importlib
from types import ModuleType

from rlx.errors import RlxError

BACKENDS = {
    "sky": "rlx.launchers.sky",
    "dstack": "rlx.launchers.dstack",
    "slurm": "rlx.launchers.slurm",
    "local": "rlx.launchers.local",
}
RENDERABLE = ("sky", "dstack", "slurm")


def get_backend(name: str) -> ModuleType:
    if name not in BACKENDS:
        raise RlxError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return importlib.import_module(BACKENDS[name])


def render(name: str, recipe, source: str) -> str:
    """Render `recipe` into the backend's native file text (pure)."""
    if name not in RENDERABLE:
        raise RlxError(
            f"backend {name!r} has no file to render; choose one of {', '.join(RENDERABLE)}"
        )
    return get_backend(name).render(recipe, source)
