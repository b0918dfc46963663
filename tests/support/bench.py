"""bench/ scripts as modules, for the tests that check them (bench/ is not a package)."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from tests.conftest import REPO


def load_bench(name: str) -> ModuleType:
    """bench/<name>.py, imported as the module `name`."""
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
