"""rlx.node.raystart: Ray's own CLI with `start` (and the rest it uses) but not the state, job
and Serve command groups, whose imports cost about 2 CPU-s of every node start."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("ray")

PROBE = """
import sys
from rlx.node.raystart import block_unused
block_unused()
import ray.scripts.scripts as scripts
print(" ".join(sorted(scripts.cli.commands)))
print("pandas" in sys.modules)
"""


def test_the_cli_keeps_start_and_drops_the_groups_it_never_uses() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True
    ).stdout.splitlines()
    commands = set(out[0].split())
    assert {"start", "stop", "status"} <= commands
    # a Ray that moved one of these imports would register its group again: noticed here
    assert not commands & {"serve", "job", "list", "summary"}, commands
    assert out[1] == "False"  # Serve's pandas stayed out


def test_ray_start_runs_through_it() -> None:
    from rlx.node.raynode import launch_argv

    argv = launch_argv(["ray", "start", "--help"])
    assert argv[:3] == [sys.executable, "-m", "rlx.node.raystart"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--head" in out.stdout and "--address" in out.stdout


def test_without_ray_here_it_is_the_ray_on_path(monkeypatch) -> None:
    import importlib.util

    from rlx.node.raynode import launch_argv

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert launch_argv(["ray", "start", "--head"]) == ["ray", "start", "--head"]
