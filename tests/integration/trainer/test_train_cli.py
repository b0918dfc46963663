"""`rlx train` turns every input mistake into one line on stderr and exit code 1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.support.cli import assert_one_line_error, run_rlx
from tests.support.hub import ANSWER_COLUMN, DATASET_ID, PROMPT_COLUMN
from tests.support.recipes import recipe_dict, write_recipe

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        (
            {"model": {"path": "/nonexistent/model"}},
            ("trainer.model.path: /nonexistent/model is not a folder",),
        ),
        (
            {"model": {"path": "tiny:qwen2-64"}},
            ("is not a tiny model spec", "tiny:qwen2-h64-l2"),
        ),
        (
            {"data": {"train": "missing/prompts.jsonl"}},
            ("trainer.data.train: missing/prompts.jsonl does not exist",),
        ),
        ({"data": {"train": "synthetic:poems"}}, ("unknown synthetic task 'synthetic:poems'",)),
        ({"reward": {"function": "nosuch"}}, ("unknown reward 'nosuch'", "letters_or_digits")),
        ({"reward": {"function": "nowhere.py:score"}}, ("file 'nowhere.py' does not exist",)),
    ],
)
def test_bad_inputs_are_one_line(tmp_path: Path, overrides, fragments) -> None:
    result = run_rlx(["train", str(write_recipe(tmp_path, **overrides))], tmp_path)
    assert_one_line_error(result, *fragments)
    record = json.loads((tmp_path / "runs" / "trainer-test" / "result.json").read_text())
    assert record["state"] == "FAILED" and fragments[0] in record["error"]


def test_more_nodes_than_ray_has_is_one_line(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path)
    data = yaml.safe_load(recipe.read_text())
    data["resources"] = {"nodes": 2}
    recipe.write_text(yaml.safe_dump(data))
    result = run_rlx(["train", str(recipe)], tmp_path)
    assert_one_line_error(
        result, "the recipe asks for 2 node(s) but the Ray cluster on this machine has 1 node(s)"
    )


def test_recipe_from_the_environment_and_an_explicit_ray_address(tmp_path: Path) -> None:
    raw = json.dumps(recipe_dict(tmp_path))
    result = run_rlx(["train"], tmp_path, RLX_RECIPE_JSON=raw, RAY_ADDRESS="auto")
    assert_one_line_error(result, "RAY_ADDRESS='auto': give the head's explicit address")
    result = run_rlx(["train"], tmp_path)
    assert_one_line_error(result, "no recipe")


def test_a_recipe_without_a_trainer(tmp_path: Path) -> None:
    path = tmp_path / "cmd.yaml"
    path.write_text("name: only-command\ncommand: [echo hi]\n")
    assert_one_line_error(run_rlx(["train", str(path)], tmp_path), "has no 'trainer:' section")


def test_the_quickstart_trains_from_a_dataset_id_and_a_resume_after_it_moved_is_refused(
    tmp_path: Path,
) -> None:
    # The quickstart's task, its prompts read by id from an offline hub cache: a named
    # configuration and split, columns of the repository's own names, held-out prompts
    # from its test split, all at the commit main named at start.
    from tests.support.hub import fill_dataset_cache, write_dataset_repo

    cache = fill_dataset_cache(tmp_path / "hub", write_dataset_repo(tmp_path / "repo", rows=32))
    spec = f"hf://{DATASET_ID}"
    settings = {
        "data": {
            "train": spec,
            "config": "letters",
            "prompt_key": PROMPT_COLUMN,
            "answer_key": ANSWER_COLUMN,
            "system_prompt": "Answer with characters only.",
            "max_prompt_length": 128,
        },
        "rollout": {"n": 4, "max_new_tokens": 8},
        "validation": {"data": spec, "every": 2, "n": 1, "max_prompts": 4},
        "checkpoint": {"dir": str(tmp_path / "ckpt"), "every": 2},
    }
    recipe = write_recipe(tmp_path, steps=2, **settings)
    result = run_rlx(["train", str(recipe)], tmp_path, **cache.env)
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "runs" / "trainer-test"
    record = json.loads((run / "result.json").read_text())
    assert record["state"] == "SUCCEEDED", record
    log = (run / "train.log").read_text()
    assert f"data: 32 prompts from {spec}@{cache.commit[:12]} (split train, config letters)" in log
    held_out = f"{spec}@{cache.commit[:12]} (split test, config letters)"
    assert f"validation: 4 held-out prompts from {held_out}" in log
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("val/pass@1" in step for step in steps)

    # main moves on to a new commit: the checkpoint recorded the run's, and the resume stops
    # in one line naming both and the pin that goes on with the run's own data.
    moved = fill_dataset_cache(cache.root, write_dataset_repo(tmp_path / "new", seed=1, rows=32))
    assert moved.commit != cache.commit
    resumed = run_rlx(
        ["train", str(write_recipe(tmp_path, steps=3, **settings))], tmp_path, **cache.env
    )
    assert_one_line_error(
        resumed,
        "cannot resume from",
        f"the run started on {spec} at commit {cache.commit[:12]} and it is at "
        f"{moved.commit[:12]} now",
        f"write {spec}@{cache.commit} in trainer.data",
    )
