"""Backends by name. A backend module is imported only when it is chosen, so the CLI stays
fast and a user needs only the libraries of the backends they use."""

from __future__ import annotations

import importlib
from types import ModuleType

from rlx.errors import RlxError

BACKENDS = {
    "sky": "rlx.launchers.sky.render",
    "dstack": "rlx.launchers.dstack.render",
    "slurm": "rlx.launchers.slurm.render",
    "local": "rlx.launchers.local.ops",
    "ray": "rlx.launchers.ray.render",
}
RENDERABLE = ("sky", "dstack", "slurm", "ray")
# Where each backend's launch, status, logs and down live: SkyPilot's and dstack's apart from
# their renderers, since they import those libraries and rendering must not.
OPERATIONS = {
    "sky": "rlx.launchers.sky.ops",
    "dstack": "rlx.launchers.dstack.ops",
    "slurm": "rlx.launchers.slurm.render",
    "local": "rlx.launchers.local.ops",
    "ray": "rlx.launchers.ray.ops",
}


def _module(table: dict[str, str], name: str) -> ModuleType:
    if name not in table:
        raise RlxError(f"unknown backend {name!r}; choose one of {', '.join(table)}")
    return importlib.import_module(table[name])


def get_backend(name: str) -> ModuleType:
    """The backend's module: render (where it has a file), SUFFIX, and what describes it."""
    return _module(BACKENDS, name)


def get_operations(name: str) -> ModuleType:
    """The module with the backend's launch, status, logs and down."""
    return _module(OPERATIONS, name)


def render(name: str, recipe, source: str) -> str:
    """Render `recipe` into the backend's native file text (pure)."""
    if name not in RENDERABLE:
        raise RlxError(
            f"backend {name!r} has no file to render; choose one of {', '.join(RENDERABLE)}"
        )
    return get_backend(name).render(recipe, source)
