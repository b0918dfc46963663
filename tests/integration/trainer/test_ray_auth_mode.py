"""One process, several Ray clusters of different auth modes, as in a test session or a
rehearsal after a local run: Ray reads RAY_AUTH_MODE once per process, so every ray.init of
rlx makes it read the environment again (rlx.trainer.main.read_ray_auth_mode_afresh)."""

from __future__ import annotations

import os
import subprocess
import sys

# In a process of its own, whose Ray has read nothing yet: a local Ray (which turns token
# auth on in the environment), a cluster without auth joined with the mode set to disabled,
# then a second private Ray, started as `rlx train` starts one, under the token mode left.
SCRIPT = """
import logging, os, ray
from rlx.node.env import environment
from rlx.trainer.main import read_ray_auth_mode_afresh
from rlx.trainer.rehearsal import RayNode, ray_nodes

def local():
    read_ray_auth_mode_afresh()
    ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level=logging.ERROR)
    ray.shutdown()

local()
assert os.environ["RAY_AUTH_MODE"] == "token", os.environ.get("RAY_AUTH_MODE")
with environment({"RAY_AUTH_MODE": "disabled"}), ray_nodes([RayNode(1, None)]) as address:
    read_ray_auth_mode_afresh()
    ray.init(address=address, logging_level=logging.ERROR)
    assert ray.cluster_resources()["CPU"] >= 1
local()
print("three clusters")
"""


def test_a_second_private_ray_after_a_cluster_without_auth_starts(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env["HOME"] = str(tmp_path)  # the token a local Ray writes lands here
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "three clusters" in result.stdout
    assert (tmp_path / ".ray" / "auth_token").exists()
