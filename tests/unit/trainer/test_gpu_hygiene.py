"""What a first GPU run needs, checked without a GPU: the controller never touches CUDA, a
colocated engine is woken weights first and fed in its own dtype, and the step metrics carry
the training GPUs' memory (torch.cuda's answers stood in for)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from rlx.runs import GPU_FREE, GPU_PEAK, GPU_RESERVED, RunResult
from rlx.trainer.actors.workers import gpu_memory, merge_gpu_memory
from rlx.trainer.checkpoint import capture_rng_state, restore_rng_state
from rlx.trainer.report.record import summary_lines
from rlx.trainer.rollout.base import RolloutEngine
from rlx.trainer.rollout.colocated import ColocatedEngine

GIB = 2**30


def test_the_controller_never_touches_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the controller asked CUDA")

    for name in ("is_available", "device_count", "get_rng_state", "get_rng_state_all"):
        monkeypatch.setattr(torch.cuda, name, refuse)
    monkeypatch.setattr(torch.cuda, "set_rng_state", refuse)
    state = capture_rng_state()  # what Trainer.save takes for the controller
    assert "cuda" not in state
    drawn = torch.rand(3)
    restore_rng_state(state)
    assert torch.equal(torch.rand(3), drawn)
    # A worker that computes on its GPU keeps its own device's state (one, not every GPU's).
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: torch.ones(4, dtype=torch.uint8))
    assert len(capture_rng_state(cuda=True)["cuda"]) == 1


class RecordingEngine(RolloutEngine):
    """A colocated vLLM engine as ColocatedEngine sees it, recording what it is asked."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.dtypes: set[torch.dtype] = set()
        self._version = 0

    def sleep(self) -> None:
        self.calls.append("sleep")

    def wake_weights(self) -> None:
        self.calls.append("wake weights")

    def wake_cache(self) -> None:
        self.calls.append("wake kv cache")

    def begin_weights(self) -> None:
        self.calls.append("begin load")

    def load_weight_bucket(self, bucket) -> int:
        self.dtypes.update(tensor.dtype for _, tensor in bucket)
        self.calls.append("load")
        return len(bucket)

    def finish_weights(self, version: int) -> None:
        self.calls.append("finish load")
        self._version = version

    @property
    def weight_version(self) -> int:
        return self._version

    def generate(self, *args, **kwargs):  # pragma: no cover - not asked here
        raise NotImplementedError

    def logprob_probe(self, prompt_ids, response_ids) -> float:  # pragma: no cover
        raise NotImplementedError

    def close(self) -> None:
        pass


def test_a_colocated_engine_wakes_weights_then_loads_then_the_cache() -> None:
    policy = torch.nn.Linear(8, 8)  # float32 master weights
    engine = RecordingEngine()
    colocated = ColocatedEngine(engine, False, can_sleep=True, dtype=torch.bfloat16)
    colocated.release()
    colocated.refresh(policy, 3)
    assert engine.calls == [
        "sleep",
        "wake weights",
        "begin load",
        "load",
        "finish load",
        "wake kv cache",
    ]
    assert engine.dtypes == {torch.bfloat16} and engine.weight_version == 3
    # Awake (a platform without sleep mode): a refresh only loads.
    engine.calls.clear()
    ColocatedEngine(engine, False, can_sleep=False, dtype=torch.bfloat16).refresh(policy, 4)
    assert engine.calls == ["begin load", "load", "finish load"]


def test_gpu_memory_is_in_the_step_metrics_and_the_summary(monkeypatch) -> None:
    figures = {"max_memory_allocated": 30 * GIB, "memory_reserved": 34 * GIB}
    for name, value in figures.items():
        monkeypatch.setattr(torch.cuda, name, lambda device=None, value=value: value)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 * GIB, 80 * GIB))
    resets = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d=None: resets.append(d))
    cuda = torch.device("cuda", 0)
    mine = gpu_memory(cuda)
    assert mine == {GPU_PEAK: 30.0, GPU_RESERVED: 34.0, GPU_FREE: 40.0} and resets == [cuda]
    other = {GPU_PEAK: 31.5, GPU_RESERVED: 33.0, GPU_FREE: 38.0}
    assert merge_gpu_memory([mine, other]) == {GPU_PEAK: 31.5, GPU_RESERVED: 34.0, GPU_FREE: 38.0}
    assert gpu_memory(torch.device("cpu")) == {} and merge_gpu_memory([{}, {}]) == {}

    result = RunResult("SUCCEEDED", "r", "/runs/r", 3, gpu_peak_gib=31.5, plan_gpu_gib=44.5)
    assert "GPU memory: at most 31.5 GiB allocated on a training GPU (rlx plan: 44.5 GiB " in (
        "\n".join(summary_lines(result))
    )
    cpu = RunResult("SUCCEEDED", "r", str(Path("/runs/r")), 3)
    assert not any(line.startswith("GPU memory") for line in summary_lines(cpu))


@pytest.mark.parametrize(
    ("use_gpu", "holds_vllm", "set_by_user", "runs_with"),
    [
        (True, False, None, "expandable_segments:True"),  # a learner alone, or an HF engine
        (True, True, None, None),  # vLLM's sleep-mode pool: the allocator's default
        (False, False, None, None),  # a CPU worker: nothing to set
        (True, False, "max_split_size_mb:512", "max_split_size_mb:512"),  # the job's own
    ],
)
def test_gpu_workers_grow_segments_unless_vllm_shares_the_process(
    monkeypatch: pytest.MonkeyPatch,
    use_gpu: bool,
    holds_vllm: bool,
    set_by_user: str | None,
    runs_with: str | None,
) -> None:
    from rlx.trainer.allocator import CUDA_ALLOC_CONF, use_allocator_settings

    monkeypatch.delenv(CUDA_ALLOC_CONF, raising=False)
    if set_by_user is not None:
        monkeypatch.setenv(CUDA_ALLOC_CONF, set_by_user)
    assert use_allocator_settings(use_gpu, holds_vllm) == runs_with
    assert os.environ.get(CUDA_ALLOC_CONF) == runs_with
