"""`rlx eval`'s inputs: every bad one is one line and exit 1, before a model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlx.trainer.evaluate import DataResult, EvalReport, metric_columns, write_results
from tests.support.cli import assert_one_line_error, invoke


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "Write digits.", "answer": "digits"}) + "\n")
    return path


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (["--n", "0"], ["--n 0", "at least 1"]),
        (["--top-p", "1.5"], ["--top-p"]),
        (["--temperature", "-1"], ["--temperature"]),
        (["--max-new-tokens", "0"], ["--max-new-tokens"]),
        (["--tp", "2"], ["--tp 2", "--engine vllm"]),
        (["--reward", "nosuchreward"], ["--reward", "nosuchreward"]),
        (["--step", "3"], ["--step", "not a recipe"]),
    ],
)
def test_bad_options_are_one_line(tiny_model_dir: Path, prompts: Path, extra, needles):
    result = invoke(["eval", str(tiny_model_dir), "--data", str(prompts), *extra])
    assert_one_line_error(result, *needles)


def test_bad_targets_and_data_are_one_line(tmp_path: Path, tiny_model_dir: Path, prompts: Path):
    missing = invoke(["eval", str(tmp_path / "nope.yaml"), "--data", str(prompts)])
    assert_one_line_error(missing, "nope.yaml", "does not exist")
    no_data = invoke(["eval", str(tiny_model_dir)])
    assert_one_line_error(no_data, "--data", "prompt file")
    no_file = invoke(["eval", str(tiny_model_dir), "--data", str(tmp_path / "gone.jsonl")])
    assert_one_line_error(no_file, "--data", "gone.jsonl", "does not exist")
    neither = tmp_path / "empty"
    neither.mkdir()
    assert_one_line_error(invoke(["eval", str(neither), "--data", str(prompts)]), "config.json")
    run = tmp_path / "run"
    (run / "step-000004").mkdir(parents=True)  # an interrupted save: no marker
    assert_one_line_error(invoke(["eval", str(run), "--data", str(prompts)]), "not a complete")


def test_summary_files_and_columns(tmp_path: Path):
    metrics = {"pass@1": 0.25, "pass@2": 0.5, "avg@2": 0.4, "maj@2": 0.0, "response_length": 3.0}
    sample = {"index": 0, "sample": 0, "reward": 1.0, "correct": True}
    one = DataResult("a/set.jsonl", metrics, [sample])
    write_results(tmp_path / "one", [one], "model")
    summary = json.loads((tmp_path / "one" / "summary.json").read_text())
    assert {"pass@1", "pass@2", "avg@2", "maj@2"} <= set(summary)
    assert summary["data"] == "a/set.jsonl" and summary["target"] == "model"
    assert json.loads((tmp_path / "one" / "samples.jsonl").read_text()) == sample
    two = DataResult("b/other.parquet", {**metrics, "pass@4": 1.0}, [sample])
    write_results(tmp_path / "two", [one, two], "model")
    assert (tmp_path / "two" / "set" / "summary.json").is_file()
    assert (tmp_path / "two" / "other" / "samples.jsonl").is_file()
    report = EvalReport("model", [one, two])
    assert metric_columns(report.results) == [
        "pass@1",
        "pass@2",
        "pass@4",
        "avg@2",
        "maj@2",
        "response_length",
    ]


def test_a_recipe_of_mixed_rewards_keeps_them_unless_a_reward_is_named():
    from rlx.recipe.model import TrainerSettings
    from rlx.trainer.evaluate import EvalOptions, Target, eval_settings

    settings = TrainerSettings.model_validate(
        {
            "model": {"path": "tiny:qwen2-h64-l2"},
            "data": {"train": "x.jsonl"},
            "rewards": [{"function": "gsm8k"}, {"url": "http://127.0.0.1:9/s", "weight": 0}],
        }
    )
    target = Target("folder", "recipe", settings)
    kept = eval_settings(target, EvalOptions())
    assert kept.rewards is not None and [t.function for t in kept.rewards][:1] == ["gsm8k"]
    chosen = eval_settings(target, EvalOptions(reward="math_exact"))
    assert chosen.rewards is None and chosen.reward.function == "math_exact"


def test_the_pass_threshold_is_the_recipes_unless_given():
    from rlx.recipe.model import TrainerSettings
    from rlx.trainer.evaluate import EvalOptions, Target, pass_threshold

    base = {"model": {"path": "tiny:qwen2-h64-l2"}, "data": {"train": "x.jsonl"}}
    graded = TrainerSettings.model_validate(
        {**base, "validation": {"data": "v.jsonl", "pass_threshold": 0.5}}
    )
    plain = TrainerSettings.model_validate(base)
    assert pass_threshold(Target("f", "recipe", graded), EvalOptions()) == 0.5
    assert pass_threshold(Target("f", "recipe", graded), EvalOptions(pass_threshold=0.8)) == 0.8
    assert pass_threshold(Target("f", "recipe", plain), EvalOptions()) == 1.0  # no validation
    assert pass_threshold(Target("f", "folder"), EvalOptions()) == 1.0
