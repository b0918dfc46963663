"""oneDNN's cache settings belong to a trainer's processes: importing rlx (its package, its
CLI, its lint) and linting a recipe leave them as they were; the actors' package, what a
Ray worker imports first, sets them where unset and keeps a value already set."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest

import rlx
import rlx.cli
import rlx.lint
import rlx.trainer
from rlx.trainer.actors import ONEDNN_CACHES, bound_onednn_caches

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml"


def caches() -> dict[str, str | None]:
    return {name: os.environ.get(name) for name in ONEDNN_CACHES}


def test_importing_rlx_and_linting_leave_onednn_caches_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ONEDNN_CACHES:
        monkeypatch.delenv(name, raising=False)
    importlib.reload(rlx)
    importlib.reload(rlx.trainer)
    rlx.lint.lint_file(RECIPE)
    assert caches() == dict.fromkeys(ONEDNN_CACHES)
    bound_onednn_caches()
    assert caches() == ONEDNN_CACHES


def test_a_value_already_set_stays(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ONEDNN_CACHES:
        monkeypatch.setenv(name, "1024")
    bound_onednn_caches()
    assert caches() == dict.fromkeys(ONEDNN_CACHES, "1024")
