"""The plan against what a GPU measured: bench/gpu_check.py's learner parts on an H100 (docs/gpu.md,
2026-11-28), planned again here for the same recipes. The plan promises its learner figure
within 15% of torch's peak allocated bytes; a change of the formulas that breaks that fails here
before a GPU run would show it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.bench import load_bench

GIB = 2**30
# peak allocated GiB over 3 GRPO steps (prepare + update), H100 80GB HBM3, torch 2.11
MEASURED_H100 = {"learner-0.5b": 10.902, "learner-1.5b": 58.435, "learner-7b-lora": 17.290}


class OnGpu:
    """What trainer_recipe reads of a check: full shapes, on CUDA."""

    tiny = False
    cuda = True

    def __init__(self, scratch: Path):
        self.scratch = scratch


@pytest.mark.parametrize("part", sorted(MEASURED_H100))
def test_the_learner_plan_is_within_its_promise_of_the_h100(part: str, tmp_path: Path) -> None:
    check = load_bench("gpu_check")
    case = next(c for c in check.CASES if c.part == part)
    (tmp_path / "config.json").write_text(json.dumps(check.model_config(case.model, tiny=False)))
    recipe = check.trainer_recipe(OnGpu(tmp_path), case, tmp_path, "H100")
    planned_bytes, items = check.learner_plan(recipe)
    planned = planned_bytes / GIB
    ratio = planned / MEASURED_H100[part]
    assert abs(ratio - 1) <= check.PLAN_PROMISE, (part, round(planned, 2), ratio)
    if part == "learner-1.5b":  # no checkpointing: autocast keeps every layer's bf16 copy
        assert {"weights, autocast's copies", "activations, no checkpointing"} <= set(items)
