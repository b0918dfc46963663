"""Backends by name: one table, name -> package (rlx.launchers.<name>). Each package declares
itself in its __init__ (a BackendSpec, see spec.py) and holds render.py (pure: the native file
or the description of the run), ops.py (launch, status, logs, down) and what it owns. The
CLI's choices, lint's backend checks and `rlx tunnel`'s hints all come from this table; a
backend's render and ops modules are imported only when it is chosen.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING, Any

from rlx.errors import RlxError
from rlx.launchers.spec import LAUNCH_OPTIONS, BackendSpec

if TYPE_CHECKING:
    from rlx.recipe import Recipe

BACKENDS = ("sky", "dstack", "slurm", "ray", "local")
DEFAULT = "local"


def spec(name: str) -> BackendSpec:
    """What backend `name` declares about itself."""
    if name not in BACKENDS:
        raise RlxError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return importlib.import_module(f"{__name__}.{name}").BACKEND


def specs() -> list[BackendSpec]:
    return [spec(name) for name in BACKENDS]


def renderable() -> list[str]:
    """Backends whose run is a native file (`rlx render --backend`)."""
    return [s.name for s in specs() if s.renders]


def taking(option: str) -> list[BackendSpec]:
    """The backends that take a launch option (of spec.LAUNCH_OPTIONS)."""
    assert option in LAUNCH_OPTIONS, option
    return [s for s in specs() if s.takes(option)]


def operations(name: str) -> ModuleType:
    """The module with the backend's launch, status, logs and down (and attach, tunnel)."""
    spec(name)
    return importlib.import_module(f"{__name__}.{name}.ops")


def render(name: str, recipe: Recipe, source: str) -> str:
    """The backend's text for `recipe` (pure): its native file, or for a backend that has
    none, the description of what `rlx launch` would run."""
    spec(name)
    return importlib.import_module(f"{__name__}.{name}.render").render(recipe, source)


def alternatives(name: str, recipe: Recipe) -> list[str]:
    """Lines saying which accelerators, spot or on-demand, places and price cap the backend
    is given for `recipe`, in the order it tries them ([] when there is nothing to choose)."""
    spec(name)
    module = importlib.import_module(f"{__name__}.{name}.render")
    return module.alternatives(recipe) if hasattr(module, "alternatives") else []


def backend_checks() -> list[Any]:
    """Every backend's own lint checks (each runs when the recipe has that backend's section)."""
    checks: list[Any] = []
    for backend in specs():
        if backend.checks:
            checks += importlib.import_module(backend.checks).CHECKS
    return checks
