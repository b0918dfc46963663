"""Rank, addresses and GPUs from each backend's environment."""

from __future__ import annotations

import pytest

from rlx.errors import RlxError
from rlx.node.env import detect_backend, node_info

SKY = {
    "SKYPILOT_NODE_RANK": "2",
    "SKYPILOT_NODE_IPS": "10.0.0.1\n10.0.0.2\n10.0.0.3\n",
    "SKYPILOT_NUM_NODES": "3",
    "SKYPILOT_NUM_GPUS_PER_NODE": "8",
    "SKYPILOT_TASK_ID": "sky-2026-11-22-00-00-00-000000_job_1",
}
DSTACK = {
    "DSTACK_NODE_RANK": "1",
    "DSTACK_MASTER_NODE_IP": "10.1.0.5",
    "DSTACK_NODES_IPS": "10.1.0.5\n10.1.0.6",
    "DSTACK_NODES_NUM": "2",
    "DSTACK_GPUS_PER_NODE": "4",
    "DSTACK_GPUS_NUM": "8",
    "DSTACK_RUN_NAME": "gsm8k-grpo",
}
SLURM = {"SLURM_JOB_ID": "77", "SLURMD_NODENAME": "gpu-b", "RLX_NODE_HOSTS": "gpu-a\ngpu-b\n"}


def test_sky():
    info = node_info("sky", SKY, gpus_per_node=0)
    assert (info.rank, info.num_nodes, info.gpus_per_node) == (2, 3, 8)
    assert info.head_ip == "10.0.0.1" and info.own_ip == "10.0.0.3"
    assert info.run_id == SKY["SKYPILOT_TASK_ID"]
    assert not info.is_head


def test_dstack():
    info = node_info("dstack", DSTACK, gpus_per_node=0)
    assert (info.rank, info.num_nodes, info.gpus_per_node) == (1, 2, 4)
    assert info.head_ip == "10.1.0.5" and info.own_ip == "10.1.0.6"
    assert info.run_id == "gsm8k-grpo"


def test_dstack_master_first_even_if_listed_later():
    env = {**DSTACK, "DSTACK_NODES_IPS": "10.1.0.6\n10.1.0.5", "DSTACK_NODE_RANK": "0"}
    info = node_info("dstack", env, gpus_per_node=0)
    assert info.node_ips == ("10.1.0.5", "10.1.0.6")


def test_slurm_resolves_hostnames():
    from rlx.node.env import from_slurm

    addresses = {"gpu-a": "10.2.0.1", "gpu-b": "10.2.0.2"}
    info = from_slurm(SLURM, gpus_per_node=8, resolve=addresses.__getitem__)
    assert info.rank == 1 and info.head_ip == "10.2.0.1" and info.own_ip == "10.2.0.2"
    assert info.describe(0) == "node 0 (gpu-a, 10.2.0.1)"
    assert info.gpus_per_node == 8 and info.run_id == "77"


def test_slurm_unresolvable_host_is_clear():
    from rlx.node.env import from_slurm

    def resolve(host: str) -> str:
        raise OSError("no")

    with pytest.raises(RlxError, match="cannot resolve node 'gpu-a'"):
        from_slurm(SLURM, gpus_per_node=0, resolve=resolve)


def test_slurm_node_not_in_job():
    from rlx.node.env import from_slurm

    with pytest.raises(RlxError, match=r"this node \(gpu-z\) is not in the job's node list"):
        from_slurm({**SLURM, "SLURMD_NODENAME": "gpu-z"}, 0, resolve=lambda h: "1.2.3.4")


def test_local_uses_a_routable_address():
    info = node_info("local", {}, gpus_per_node=0)
    assert info.num_nodes == 1 and info.is_head


def test_detect():
    assert detect_backend(SKY) == "sky"
    assert detect_backend(DSTACK) == "dstack"
    assert detect_backend(SLURM) == "slurm"
    assert detect_backend({}) == "local"
    assert node_info("auto", SKY, 0).backend == "sky"


@pytest.mark.parametrize(
    "env,message",
    [
        ({**SKY, "SKYPILOT_NUM_NODES": "4"}, "4 nodes announced but 3 node addresses"),
        ({**SKY, "SKYPILOT_NODE_RANK": "5"}, "rank 5 is outside 0..2"),
        ({**SKY, "SKYPILOT_NODE_RANK": "x"}, "is not a whole number"),
        (
            {k: v for k, v in SKY.items() if k != "SKYPILOT_NODE_IPS"},
            "SKYPILOT_NODE_IPS is not set",
        ),
    ],
)
def test_sky_errors(env, message):
    with pytest.raises(RlxError, match=message):
        node_info("sky", env, 0)


def test_dstack_missing_ips():
    env = {k: v for k, v in DSTACK.items() if k != "DSTACK_NODES_IPS"}
    with pytest.raises(RlxError, match="DSTACK_NODES_IPS is not set"):
        node_info("dstack", env, 0)
