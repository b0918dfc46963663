"""Tensor-parallel rollout engines in the split layout. On GPUs an engine's placement group
has one GPU per bundle and its actor lets vLLM's Ray executor take them; here that is
checked with a real Ray that declares GPUs and vLLM's own acceptance code for the executor's
placement group (only the platform's Ray device key is set, since the CPU platform has
none). The executor is chosen explicitly and CPU engines get their cores split.
(A TP=2 engine generating and taking pushes on CPU: test_vllm.py.)
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlx.plan.actors import tensor_parallel_bundles
from rlx.trainer.actors.placement import alive_nodes, reserve, rollout_actor_options
from rlx.trainer.rollout.vllm_options import cpu_binding, vllm_options
from tests.support.recipes import make_recipe

pytest.importorskip("ray")
pytestmark = pytest.mark.timeout(300)


def test_cpu_workers_get_their_own_cores() -> None:
    assert cpu_binding(2, [0, 1]) == "0|1"
    assert cpu_binding(2, list(range(8))) == "0,1,2,3|4,5,6,7"
    assert cpu_binding(4, [2, 3, 4, 5, 6, 7]) == "2|3|4|5"  # equal shares, one core left
    assert cpu_binding(2, [5]) == "5|5"  # fewer cores than workers: shared


def test_the_executor_is_chosen_explicitly(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = make_recipe(tmp_path, rollout={"engine": "vllm"}).trainer
    gpu = vllm_options(settings, 2, str(tiny_model_dir), use_gpu=True)
    assert gpu["distributed_executor_backend"] == "ray" and gpu["tensor_parallel_size"] == 2
    # Set here only for the test (restored after it): the options bind a CPU engine's workers.
    for name in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_ENABLE_V1_MULTIPROCESSING"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    cpu = vllm_options(settings, 2, str(tiny_model_dir), use_gpu=False)
    assert cpu["distributed_executor_backend"] == "mp" and "gpu_memory_utilization" not in cpu
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == cpu_binding(2)
    # The engine core in the actor's own process; only the workers have processes.
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    one = vllm_options(settings, 1, str(tiny_model_dir), use_gpu=True)
    assert "distributed_executor_backend" not in one  # one GPU: vLLM runs in the actor
    # A prompt, the longest response, and the one token the probe's request generates.
    assert one["max_model_len"] == 64 + 32 + 1


@pytest.fixture(scope="module")
def gpu_ray():
    """A private Ray that declares 4 GPUs (Ray schedules them as resources; nothing here
    touches a device)."""
    import ray

    from rlx.trainer.main import read_ray_auth_mode_afresh

    read_ray_auth_mode_afresh()  # an earlier module's cluster may have left another mode
    ray.init(
        address="local",
        num_cpus=4,
        num_gpus=4,
        include_dashboard=False,
        logging_level=logging.ERROR,
        log_to_driver=False,
    )
    yield ray
    ray.shutdown()


class EngineSeat:
    """Stands where a RolloutWorker stands and runs vLLM's placement-group acceptance."""

    def what_vllm_sees(self, tensor_parallel: int) -> dict:
        import ray
        from vllm.platforms import current_platform
        from vllm.v1.executor import ray_utils

        # The CPU platform has no Ray device; a GPU platform's key is "GPU".
        current_platform.ray_device_key = "GPU"
        config = SimpleNamespace(
            placement_group=None,
            world_size=tensor_parallel,
            tensor_parallel_size=tensor_parallel,
            ray_runtime_env=None,
        )
        try:
            ray_utils.initialize_ray_cluster(config)
        except ValueError as exc:
            return {"accepted": False, "error": str(exc)}
        group = ray.util.get_current_placement_group()
        return {
            "accepted": True,
            "same_group": config.placement_group.id == group.id,
            "bundles": group.bundle_specs,
            "gpu_ids": ray.get_gpu_ids(),
        }


def seat(ray, group, rollout_gpus: int, tensor_parallel: int) -> dict:
    actor = ray.remote(EngineSeat).options(**rollout_actor_options(rollout_gpus, group, 0))
    handle = actor.remote()
    try:
        # A hang bound, not a speed check: the actor imports vLLM in a fresh worker, which
        # took 25 s alone and over 120 s beside two other test workers on 2 cores.
        return ray.get(handle.what_vllm_sees.remote(tensor_parallel), timeout=600)
    finally:
        ray.kill(handle)


def test_vllm_ray_executor_accepts_the_engine_group(gpu_ray) -> None:
    pytest.importorskip("vllm")
    ray = gpu_ray
    group, ips = reserve(
        1, 1, "STRICT_PACK", "an engine", alive_nodes(), bundles=tensor_parallel_bundles(2)
    )
    try:
        seen = seat(ray, group, 2, 2)
        assert seen["accepted"], seen
        assert seen["same_group"]  # vLLM uses the group rlx reserved, not one of its own
        assert [b.get("GPU") for b in seen["bundles"]] == [1.0, 1.0]
        assert seen["gpu_ids"] == []  # the actor holds no GPU: each goes to a vLLM worker
        assert len(set(ips)) == 1
    finally:
        ray.util.remove_placement_group(group)

    # What rlx did before: one bundle holding the engine's two GPUs. vLLM refuses it.
    group, _ = reserve(1, 2, "PACK", "an engine", alive_nodes())
    try:
        seen = seat(ray, group, 2, 2)
        assert not seen["accepted"]
        assert "bundle cannot have more than 1 GPU" in seen["error"]
    finally:
        ray.util.remove_placement_group(group)
