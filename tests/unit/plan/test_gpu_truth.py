"""The plan against what a GPU measured: bench/gpu_check.py's learner parts on an H100 (docs/gpu.md,
2026-11-28), planned again here for the same recipes. The plan promises its learner figure
within 15% of torch's peak allocated bytes; a change of the formulas that breaks that fails here
before a GPU run would show it."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from rlx.plan.planner import plan_recipe
from tests.conftest import REPO

GIB = 2**30
# peak allocated GiB over 3 GRPO steps (prepare + update), H100 80GB HBM3, torch 2.11
MEASURED_H100 = {"learner-0.5b": 10.902, "learner-1.5b": 58.435, "learner-7b-lora": 17.290}


def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "bench" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


class OnGpu:
    """What trainer_recipe reads of a check: full shapes, on CUDA."""

    tiny = False
    cuda = True

    def __init__(self, scratch: Path):
        self.scratch = scratch


@pytest.mark.parametrize("part", sorted(MEASURED_H100))
def test_the_learner_plan_is_within_its_promise_of_the_h100(part: str, tmp_path: Path) -> None:
    check = gpu_check()
    case = next(c for c in check.CASES if c.part == part)
    (tmp_path / "config.json").write_text(json.dumps(check.model_config(case.model, tiny=False)))
    recipe = check.trainer_recipe(OnGpu(tmp_path), case, tmp_path, "H100")
    budget = plan_recipe(recipe, advise=False).gpus[0]
    update = [i for i in budget.items if i.phase in ("all", "update")]
    planned = sum(i.bytes for i in update if not i.name.startswith("runtime")) / GIB
    ratio = planned / MEASURED_H100[part]
    assert abs(ratio - 1) <= check.PLAN_PROMISE, (part, round(planned, 2), ratio)
    if part == "learner-1.5b":  # no checkpointing: autocast keeps every layer's bf16 copy
        names = {i.name for i in update}
        assert {"weights, autocast's copies", "activations, no checkpointing"} <= names
