"""resources.fabric on the nodes: NCCL's and libfabric's variables reach Ray's processes (and
so the trainer's), and never over a value the recipe's env or the node's environment gives."""

from __future__ import annotations

import io

import pytest

from rlx.node import bootstrap, raynode
from rlx.node.env import FABRIC_ENV, NodeInfo, fabric_env
from rlx.recipe import parse_recipe
from rlx.recipe.model import Recipe

HEAD, WORKER = "10.0.0.1", "10.0.0.2"


def job(fabric: str | None, env: str = "") -> Recipe:
    text = 'name: fab\ncommand: ["true"]\nray: {auth: none}\n'
    if fabric is not None:
        text += f"resources: {{nodes: 2, fabric: {fabric}}}\n"
    return parse_recipe(text + env, "fab.yaml").recipe


def test_each_fast_fabric_has_its_variables():
    assert fabric_env(job("efa"), {}) == {"FI_PROVIDER": "efa", "FI_EFA_FORK_SAFE": "1"}
    assert fabric_env(job("infiniband"), {}) == {"NCCL_IB_DISABLE": "0", "NCCL_NET": "IB"}
    assert fabric_env(job("tcp"), {}) == {} and fabric_env(job(None), {}) == {}
    assert set(FABRIC_ENV) == {"efa", "infiniband", "tcp"}  # every value the field takes


def test_the_recipe_and_the_node_win():
    recipe = job("infiniband", "env: {NCCL_NET: IBext}\n")
    # the recipe's own value, whether or not the backend already exported it
    assert fabric_env(recipe, {}) == {"NCCL_IB_DISABLE": "0"}
    # a value the node has (a cluster's module, SkyPilot's own on Kubernetes) stays too
    assert fabric_env(recipe, {"NCCL_IB_DISABLE": "1"}) == {}


@pytest.fixture
def clean_auth(monkeypatch):
    for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv(raynode.GCS_CONNECT_TIMEOUT_ENV, "30")


def boot(recipe: Recipe, env: dict[str, str], rank: int) -> bootstrap.Bootstrap:
    node = NodeInfo("sky", rank, (HEAD, WORKER), (HEAD, WORKER), 8, None)
    return bootstrap.Bootstrap(recipe, node, env, out=io.StringIO())


def test_ray_and_the_trainer_start_with_them(clean_auth, monkeypatch):
    recipe = job("efa", "env: {FI_EFA_FORK_SAFE: '0'}\n")
    # as the backend gives it: the recipe's env exported, and a node value of its own
    node_env = {"FI_EFA_FORK_SAFE": "0", "PATH": "/usr/bin"}
    head = boot(recipe, node_env, 0)
    assert head.ray_env["FI_PROVIDER"] == "efa" and head.ray_env["FI_EFA_FORK_SAFE"] == "0"
    assert head.head_command_env()["FI_PROVIDER"] == "efa"
    worker = boot(recipe, node_env, 1)
    seen: list[dict[str, str]] = []
    monkeypatch.setattr(raynode, "run_ray_start", lambda _argv, env, _t, _hold: seen.append(env))
    monkeypatch.setattr(raynode, "raylet_alive", lambda _a, _p: True)

    class Gcs:
        def nodes(self) -> list[raynode.NodeState]:
            return [raynode.NodeState(HEAD, True, 0.0), raynode.NodeState(WORKER, True, 0.0)]

    worker.start_worker_ray(Gcs())  # type: ignore[arg-type]
    assert seen and seen[0]["FI_PROVIDER"] == "efa" and seen[0]["FI_EFA_FORK_SAFE"] == "0"


def test_no_fabric_adds_nothing(clean_auth):
    head = boot(job(None), {"PATH": "/usr/bin"}, 0)
    assert not any(k.startswith(("FI_", "NCCL_")) for k in head.ray_env)
