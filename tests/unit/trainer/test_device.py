"""The start-up choice of `auto` sizes from the GPUs a node reports (name and memory as CUDA
gives them, for real GPUs), checked against the plan of that GPU; and where the job runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rlx.errors import RlxError
from rlx.plan import plan_recipe
from rlx.plan.budget import HEADROOM
from rlx.plan.sizing import with_sizes
from rlx.recipe import load_recipe
from rlx.recipe.model import Recipe
from rlx.trainer.device import Devices, placement, size_at_start
from tests.conftest import RECIPES

# torch.cuda.get_device_properties(0): name and total_memory of real GPUs
H100 = Devices("NVIDIA H100 80GB HBM3", 85520809984, 8)
A100_40GB = Devices("NVIDIA A100-SXM4-40GB", 42505273344, 8)
L4 = Devices("NVIDIA L4", 23580639232, 8)
L40S = Devices("NVIDIA L40S", 47810936832, 8)
SEVEN_B = Path(__file__).parents[1] / "plan" / "recipes" / "alternatives-7b.yaml"
ALL_AUTO = {
    "micro_batch_size": "auto",
    "gpu_memory_utilization": "auto",
    "tensor_parallel_size": "auto",
}


def _small() -> Recipe:
    """gsm8k-grpo (Qwen2.5-0.5B, colocated) on any of the four, sizes left to auto."""
    recipe = load_recipe(RECIPES / "gsm8k-grpo.yaml").recipe
    resources = recipe.resources.model_copy(
        update={"accelerators": ["L4:1", "A100-40GB:1", "L40S:1", "H100:1"]}
    )
    return with_sizes(recipe.model_copy(update={"resources": resources}), **ALL_AUTO)  # type: ignore[arg-type]


def _seven_b() -> Recipe:
    return with_sizes(load_recipe(SEVEN_B).recipe, **ALL_AUTO)  # type: ignore[arg-type]


def _assert_fits_its_gpu(recipe: Recipe, devices: Devices) -> None:
    started = size_at_start(recipe, {}, devices)
    sizes = started.sizes
    assert sizes is not None and not sizes.problems
    assert started.alternative.split(":")[0] == devices.table_name
    plan = plan_recipe(started.recipe, started.env)  # the GPU's memory as reported
    assert plan.gpus[0].capacity == devices.total_bytes - devices.total_bytes % 2**20 or (
        abs((plan.gpus[0].capacity or 0) - devices.total_bytes) < 2**21
    )
    assert plan.fits and not plan.warnings, plan.problems + plan.warnings
    assert all((b.headroom or 1) >= HEADROOM for b in plan.gpus)
    # the largest that fits: twice the micro-batch does not (or is more than a rank gets)
    double = plan_recipe(
        with_sizes(started.recipe, micro_batch_size=2 * sizes.micro_batch_size), started.env
    )
    assert (double.gpus[0].headroom or 0) < HEADROOM or sizes.micro_batch_size >= 64
    assert sizes.tensor_parallel_size == 1  # colocated: one engine per training GPU
    assert 0.1 <= sizes.gpu_memory_utilization <= 0.9


@pytest.mark.parametrize("devices", [H100, A100_40GB, L4, L40S], ids=lambda d: d.table_name)
def test_small_recipe_sizes_fit_each_gpu(devices: Devices) -> None:
    _assert_fits_its_gpu(_small(), devices)


@pytest.mark.parametrize("devices", [H100, A100_40GB, L40S], ids=lambda d: d.table_name)
def test_7b_sizes_fit_each_gpu_that_can_hold_it(devices: Devices) -> None:
    _assert_fits_its_gpu(_seven_b(), devices)


def test_7b_on_l4s_is_refused_in_one_line() -> None:
    with pytest.raises(RlxError) as caught:
        size_at_start(_seven_b(), {}, L4)
    message = str(caught.value)
    assert "\n" not in message and message.startswith("trainer.batch.micro_batch_size: auto")
    assert "drop L4:8 from resources.accelerators" in message


def test_sizes_follow_the_gpu() -> None:
    chosen = {d.name: size_at_start(_seven_b(), {}, d).sizes for d in (H100, A100_40GB)}
    h100, a100 = chosen[H100.name], chosen[A100_40GB.name]
    assert h100 is not None and a100 is not None
    assert h100.micro_batch_size > a100.micro_batch_size
    assert h100.gpu_memory_utilization > a100.gpu_memory_utilization


def test_an_unknown_gpu_is_planned_by_the_memory_it_reports() -> None:
    started = size_at_start(_seven_b(), {}, Devices("NVIDIA Future 120GB", 120 * 2**30, 8))
    assert started.alternative == "Future-120GB:8"
    plan = plan_recipe(started.recipe, started.env)
    assert plan.gpus[0].capacity == 120 * 2**30 and plan.fits


def test_the_line_and_summary_name_the_gpu_and_where_it_runs() -> None:
    env = {
        "SKYPILOT_CLUSTER_INFO": json.dumps(
            {"cluster_name": "c", "cloud": "AWS", "region": "us-east-1", "zone": None}
        )
    }
    started = size_at_start(_seven_b(), env, H100)
    line = started.line()
    assert "\n" not in line
    assert line.startswith("accelerator: 8 x NVIDIA H100 80GB HBM3 (79.6 GiB) = H100:8")
    assert "cloud aws, region us-east-1, on-demand" in line
    assert "micro_batch_size 64 (auto)" in line
    summary = started.to_json()
    assert summary["device"] == H100.name and summary["count"] == 8
    assert summary["sizes"]["micro_batch_size"] == 64
    assert placement({}, _seven_b()) == {
        "cloud": "unknown",
        "region": "unknown",
        "market": "on-demand",
    }


def test_without_gpus_a_cpu_recipe_sizes_from_host_memory(tmp_path: Path) -> None:
    data = yaml.safe_load((RECIPES / "quickstart.yaml").read_text())
    data["trainer"]["batch"]["micro_batch_size"] = "auto"
    path = tmp_path / "q.yaml"
    path.write_text(yaml.safe_dump(data))
    recipe = load_recipe(path).recipe
    roomy = size_at_start(recipe, {}, None, host_bytes=64 * 2**30).sizes
    # 4.0 GiB for the processes, 1.3 MiB per sequence in a micro-batch
    tight = size_at_start(recipe, {}, None, host_bytes=int(4.5 * 2**30)).sizes
    assert roomy is not None and tight is not None
    assert roomy.micro_batch_size == 64  # all of a rank's share
    assert 1 <= tight.micro_batch_size < roomy.micro_batch_size
    with pytest.raises(RlxError, match="micro_batch_size: auto: on CPU even one sequence"):
        size_at_start(recipe, {}, None, host_bytes=3 * 2**30)


def test_the_run_summary_names_the_accelerator() -> None:
    from rlx.runs import RunResult
    from rlx.trainer.report.record import summary_lines

    started = size_at_start(_seven_b(), {}, A100_40GB)
    result = RunResult(state="SUCCEEDED", run_id="r", run_dir="/tmp/r", steps=1, last_step=1)
    result.accelerator = started.to_json()
    lines = summary_lines(result)
    assert lines[1] == started.line() and "= A100-40GB:8" in lines[1]
    assert "micro_batch_size 8 (auto)" in lines[1]
