"""Accelerator alternatives and `auto` sizes: `rlx plan` plans every alternative, lint refuses
one that does not fit (naming it and what to change), and `auto` chooses sizes that fit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from rlx.cli import app
from rlx.plan import plan_recipe
from rlx.plan.budget import HEADROOM, unknown_accelerator
from rlx.plan.planner import plan_alternatives, size_recipe
from rlx.plan.sizing import with_sizes
from rlx.recipe import load_recipe
from rlx.recipe.model import Recipe, fixed_int
from tests.conftest import RECIPES

runner = CliRunner()
# A 7B full fine-tune on {H100:8, A100-40GB:8, L4:8} with fixed sizes: only the H100s fit.
SEVEN_B = Path(__file__).parent / "recipes" / "alternatives-7b.yaml"
AUTO = {"micro_batch_size": "auto", "gpu_memory_utilization": "auto"}


def _write(tmp_path: Path, accelerators: Any, **sizes: Any) -> Path:
    data = yaml.safe_load(SEVEN_B.read_text())
    data["resources"]["accelerators"] = accelerators
    for name, value in sizes.items():
        section = "batch" if name == "micro_batch_size" else "rollout"
        data["trainer"][section][name] = value
    path = tmp_path / f"alt-{len(list(tmp_path.iterdir()))}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _lint(path: Path, *args: str) -> tuple[int, list[str]]:
    result = runner.invoke(app, ["lint", *args, str(path)])
    assert "Traceback" not in result.output
    return result.exit_code, [line for line in result.output.splitlines() if ": error: " in line]


def test_plan_prints_a_row_per_alternative_with_numbers() -> None:
    result = runner.invoke(app, ["plan", str(SEVEN_B)], env={"COLUMNS": "200"})
    assert result.exit_code == 1, result.output  # two of them do not fit
    rows = {line.split()[0]: line for line in result.output.splitlines() if "│" in line}
    assert "train 48.9/79.2" in rows["H100:8"] and "yes" in rows["H100:8"]
    assert "train 48.9/40.0" in rows["A100-40GB:8"] and "no" in rows["A100-40GB:8"]
    assert "train 48.9/22.5" in rows["L4:8"] and "activations" in rows["L4:8"]
    # then the preferred one's detailed plan, as for a recipe with one accelerator
    assert "H100:8, 8 training rank(s)" in result.output


def test_lint_names_each_alternative_that_does_not_fit_and_what_to_change() -> None:
    code, errors = _lint(SEVEN_B)
    assert code == 1 and len(errors) == 2, errors
    a100, l4 = sorted(errors)
    assert "resources.accelerators: A100-40GB:8: does not fit: training GPU: needs 48.9" in a100
    assert "drop A100-40GB:8 from resources.accelerators" in a100
    # auto would make the A100s fit: lint says so, with the sizes it would choose
    assert "batch.micro_batch_size: auto (8 here)" in a100
    assert "L4:8: does not fit" in l4 and "drop L4:8" in l4 and ": auto (" not in l4


def test_lint_accepts_the_alternatives_that_fit(tmp_path: Path) -> None:
    assert _lint(_write(tmp_path, ["H100:8"]), "--strict") == (0, [])


def test_auto_sizes_make_the_a100s_fit_and_lint_still_refuses_the_l4s(tmp_path: Path) -> None:
    code, errors = _lint(
        _write(tmp_path, {"H100:8": None, "A100-40GB:8": None, "L4:8": None}, **AUTO)
    )
    assert code == 1 and len(errors) == 1 and "L4:8: does not fit" in errors[0], errors
    assert "micro_batch_size: auto" in errors[0] and "22.5 GiB" in errors[0]
    assert "drop L4:8 from resources.accelerators" in errors[0]
    path = _write(tmp_path, {"H100:8": None, "A100-40GB:8": None}, **AUTO)
    assert _lint(path, "--strict") == (0, [])
    rows = plan_alternatives(load_recipe(path).recipe)
    assert [(a.label, a.fits) for a in rows] == [("H100:8", True), ("A100-40GB:8", True)]
    h100, a100 = (a.plan.sizes for a in rows if a.plan is not None)
    assert h100 is not None and a100 is not None
    assert h100.micro_batch_size > a100.micro_batch_size >= 1  # the sizes follow the GPU


def test_a_set_mixing_counts_the_batch_cannot_split_is_one_error(tmp_path: Path) -> None:
    code, errors = _lint(_write(tmp_path, {"H100:8": None, "A100-80GB:6": None}))
    assert code == 1 and len(errors) == 1, errors
    assert "with A100-80GB:6, trainer.batch.prompts_per_step" in errors[0]
    assert "drop A100-80GB:6 from resources.accelerators" in errors[0]


def test_an_unknown_accelerator_is_an_error_with_a_way_for_custom_hardware(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _write(tmp_path, ["H100:8", "TPU-v9:8"])
    code, errors = _lint(path)
    assert code == 1 and len(errors) == 1
    assert "TPU-v9:8: accelerator 'TPU-v9' has no memory size" in errors[0]
    assert "RLX_ACCELERATOR_GIB='TPU-v9=GIB'" in errors[0]
    monkeypatch.setenv("RLX_ACCELERATOR_GIB", "TPU-v9=96")
    assert _lint(path, "--strict") == (0, [])


@pytest.mark.parametrize(
    ("written", "guess"),
    [
        ("A10GG", "did you mean 'A10G' or 'A10' or 'A100'? use the table's name"),
        ("H100-80GB", "did you mean 'H100'? use"),  # its own family, not A100-80GB
        ("RTX-4090", "did you mean 'RTX4090' or 'RTXA6000'? use"),
        ("a10g-24gb", "did you mean 'A10G'? use"),  # dstack's style of name
        ("TPU-v9", "for it; use the table's name"),  # nothing near: no guess
    ],
)
def test_an_unknown_accelerator_says_which_name_was_meant(written: str, guess: str) -> None:
    message = unknown_accelerator(written)
    assert guess in message and f"'{written}=GIB'" in message


def test_auto_where_a_number_is_needed_is_one_line(tmp_path: Path) -> None:
    data = yaml.safe_load(SEVEN_B.read_text())
    data["trainer"]["batch"]["prompts_per_step"] = "auto"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    code, errors = _lint(path)
    assert code == 1 and len(errors) == 1 and "prompts_per_step" in errors[0]
    recipe = with_sizes(load_recipe(SEVEN_B).recipe, tensor_parallel_size="auto")  # type: ignore[arg-type]
    with pytest.raises(Exception, match="tensor_parallel_size: auto is chosen for the GPU"):
        fixed_int(
            recipe.trainer.rollout.tensor_parallel_size, "trainer.rollout.tensor_parallel_size"
        )  # type: ignore[union-attr]


def _sized(recipe: Recipe) -> tuple[Recipe, Any]:
    sized, sizes = size_recipe(recipe, {})
    assert not sizes.problems, sizes.problems
    return sized, sizes


def test_auto_micro_batch_is_the_largest_power_of_two_that_fits(tmp_path: Path) -> None:
    recipe = load_recipe(_write(tmp_path, "A100-40GB:8", **AUTO)).recipe
    sized, sizes = _sized(recipe)
    assert sizes.auto == ("micro_batch_size", "gpu_memory_utilization")
    plan = plan_recipe(sized, {})
    assert plan.fits and not plan.warnings and plan.gpus[0].headroom >= HEADROOM  # type: ignore[operator]
    bigger = plan_recipe(with_sizes(sized, micro_batch_size=2 * sizes.micro_batch_size), {})
    assert bigger.gpus[0].headroom < HEADROOM  # type: ignore[operator]
    more = plan_recipe(
        with_sizes(sized, gpu_memory_utilization=sizes.gpu_memory_utilization + 0.05), {}
    )
    assert more.gpus[0].headroom < HEADROOM  # type: ignore[operator]


def test_auto_tensor_parallel_is_the_fewest_gpus_that_hold_the_engine() -> None:
    recipe = load_recipe(RECIPES / "grpo-large.yaml").recipe
    sized, sizes = _sized(with_sizes(recipe, tensor_parallel_size="auto"))  # type: ignore[arg-type]
    # 32B in bf16 is 61 GiB: one H100 holds it with too little KV cache, two hold it
    assert sizes.tensor_parallel_size == 2
    assert plan_recipe(sized, {}).fits
    one = plan_recipe(with_sizes(sized, tensor_parallel_size=1), {})
    assert (one.gpus[-1].engine_sequences or 0) < 8


def test_a_fixed_size_stays_fixed(tmp_path: Path) -> None:
    recipe = load_recipe(_write(tmp_path, "H100:8", gpu_memory_utilization="auto")).recipe
    sized, sizes = _sized(recipe)
    assert sizes.auto == ("gpu_memory_utilization",)
    assert sized.trainer is not None and sized.trainer.batch.micro_batch_size == 32


def test_plan_json_has_every_alternative() -> None:
    import json

    result = runner.invoke(app, ["plan", "--json", str(SEVEN_B)])
    out = json.loads(result.output)
    assert out["accelerator"] == "H100:8"  # the preferred one's plan, as before
    rows = [(a["label"], a["fits"]) for a in out["alternatives"]]
    assert rows == [("H100:8", True), ("A100-40GB:8", False), ("L4:8", False)]
