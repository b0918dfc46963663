"""ray.debug: the variables every node's Ray gets, the legacy flag and its lint warning (a
real debugger session on three hosts is in tests/hosts/test_rayjobs.py)."""

from __future__ import annotations

import yaml

from rlx.lint import lint_loaded
from rlx.node import raynode
from rlx.recipe import parse_recipe


def settings(debug: str):
    text = yaml.safe_dump({"name": "dbg", "command": ["true"], "ray": {"debug": debug}})
    return parse_recipe(text, "d.yaml").recipe.ray


def test_each_mode_sets_rays_own_variables() -> None:
    env = raynode.ray_env({}, "tok", "post-mortem")
    assert env["RAY_DEBUG"] == "1" and env["RAY_DEBUG_POST_MORTEM"] == "1"
    env = raynode.ray_env({}, "tok", "breakpoints")
    assert env["RAY_DEBUG"] == "1" and "RAY_DEBUG_POST_MORTEM" not in env
    assert raynode.ray_env({}, "tok", "legacy")["RAY_DEBUG"] == "legacy"
    assert "RAY_DEBUG" not in raynode.ray_env({}, "tok", "off")


def test_legacy_listens_externally_and_lint_says_so() -> None:
    for head in (True, False):
        argv = (
            raynode.head_command(settings("legacy"), "10.0.0.1", 0)
            if head
            else raynode.worker_command(settings("legacy"), "10.0.0.1", "10.0.0.2", 0)
        )
        assert "--ray-debugger-external" in argv
    assert "--ray-debugger-external" not in raynode.head_command(
        settings("post-mortem"), "10.0.0.1", 0
    )
    text = yaml.safe_dump({"name": "dbg", "command": ["true"], "ray": {"debug": "legacy"}})
    findings = [f for f in lint_loaded(parse_recipe(text, "d.yaml")) if f.field == "ray.debug"]
    assert len(findings) == 1 and findings[0].severity == "warning"
    assert "--ray-debugger-external" in findings[0].message
