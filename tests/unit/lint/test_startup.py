"""A recipe that lint passes is never refused at the trainer's start-up: `rlx train` runs
lint's own checks (rlx.lint.STARTUP_CHECKS) when it narrows the recipe (TrainJob.of), so the
two cannot drift apart. What lint cannot see (files and packages on the head, the data's
rows) the trainer refuses where it reads them, before any actor starts, in one line that
names the field."""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlx.errors import RlxError
from rlx.lint import STARTUP_CHECKS, all_checks, lint_loaded
from rlx.recipe import load_recipe
from rlx.trainer.job import TrainJob
from rlx.trainer.main import run_training

BASE = """
name: twins
resources: {nodes: 1}
trainer:
  algorithm: grpo
  model: {path: "tiny:qwen2-h64-l2", dtype: float32}
  data: {train: "synthetic:letters_or_digits", max_prompt_length: 64}
  reward: {function: letters_or_digits}
  rollout: {engine: hf, n: 4, max_new_tokens: 16}
  batch: {prompts_per_step: 8, micro_batch_size: 4}
"""


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(recipe: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = recipe
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value

    return change


def _all(*changes: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def change(recipe: dict[str, Any]) -> None:
        for one in changes:
            one(recipe)

    return change


GPUS = _set("resources.accelerators", "H100:8")


def _groups(train: dict[str, Any], rollout: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    """resources.groups in place of resources.nodes."""
    return _set("resources", {"groups": {"train": train, "rollout": rollout}})


SPLIT = _set("trainer.layout", "split")


def _terms(*terms: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    """trainer.rewards in place of trainer.reward."""

    def change(recipe: dict[str, Any]) -> None:
        recipe["trainer"].pop("reward", None)
        recipe["trainer"]["rewards"] = list(terms)

    return change


VALIDATION = {"data": "synthetic:letters_or_digits", "n": 4}
BEST_PASS8 = {"dir": "ckpt", "best": {"metric": "val/pass@8"}}
BEST_MAJ = {"dir": "ckpt", "best": {"metric": "val/maj@4", "mode": "max"}}

# Per start-up check: recipes it refuses (a change to BASE) and the field it names.
BROKEN: dict[str, list[tuple[Callable[[dict[str, Any]], None], str]]] = {
    "check_batch_divisibility": [
        (_set("trainer.batch.minibatch_size", 24), "trainer.batch.minibatch_size"),
        (_all(_set("resources.nodes", 3)), "trainer.batch.prompts_per_step"),
    ],
    "check_tensor_parallel": [
        (
            _all(GPUS, _set("trainer.rollout.tensor_parallel_size", 3)),
            "trainer.rollout.tensor_parallel_size",
        )
    ],
    "check_rollout_engine": [
        (_set("trainer.rollout.min_new_tokens", 32), "trainer.rollout.min_new_tokens")
    ],
    "check_group_size": [
        (_set("trainer.rollout.n", 1), "trainer.rollout.n"),
        (
            _all(
                _set("trainer.algorithm", "reinforce_pp"),
                _set("trainer.algo.baseline", "group"),
                _set("trainer.rollout.n", 1),
            ),
            "trainer.rollout.n",
        ),
    ],
    "check_policy_loss": [
        (_set("trainer.algo.policy_loss", "gspo"), "trainer.algo.loss_agg"),
        (
            _all(_set("trainer.algo.policy_loss", "cispo"), _set("trainer.algo.dual_clip", 3.0)),
            "trainer.algo.dual_clip",
        ),
    ],
    "check_rollout_correction": [
        (_set("trainer.algo.rollout_correction", {"low": 1.5}), "trainer.algo.rollout_correction"),
        (
            _set("trainer.algo.rollout_correction", {"action": "mask", "high": 3.0}),
            "trainer.algo.rollout_correction",
        ),
    ],
    "check_overlong": [
        (_set("trainer.algo.overlong", {"buffer": 16}), "trainer.algo.overlong.buffer"),
        (
            _all(
                _set("trainer.algo.overlong", {"mask_truncated": True}),
                _set("trainer.environment", {"function": "calculator"}),
            ),
            "trainer.algo.overlong",
        ),
    ],
    "check_filter_groups": [
        (
            _all(_set("trainer.batch.filter_groups", {}), _set("trainer.rollout.n", 1)),
            "trainer.batch.filter_groups",
        ),
    ],
    "check_rollout_dtype": [
        (
            _all(
                _set("trainer.rollout.dtype", "bfloat16"), _set("trainer.model.lora", {"rank": 4})
            ),
            "trainer.rollout.dtype",
        )
    ],
    "check_layout": [
        (
            _all(GPUS, _set("trainer.layout", "split"), _set("trainer.rollout_gpus", 8)),
            "trainer.rollout_gpus",
        )
    ],
    "check_colocated_tensor_parallel": [
        (
            _all(GPUS, _set("trainer.rollout.tensor_parallel_size", 2)),
            "trainer.rollout.tensor_parallel_size",
        ),
        (
            _all(
                GPUS,
                _set("trainer.layout", "split"),
                _set("trainer.rollout_gpus", 4),
                _set("trainer.rollout.tensor_parallel_size", 2),
            ),
            "trainer.rollout.tensor_parallel_size",
        ),
    ],
    "check_groups_layout": [(_groups({"nodes": 1}, {"nodes": 1}), "trainer.layout")],
    "check_groups_accelerators": [
        (
            _all(_groups({"accelerators": "H100:8"}, {"nodes": 2}), SPLIT),
            "resources.groups.rollout",
        )
    ],
    "check_groups_rollout_gpus": [
        (
            _all(
                _groups({"accelerators": "H100:1"}, {"nodes": 2, "accelerators": "L4:2"}),
                SPLIT,
                _set("trainer.rollout_gpus", 2),
            ),
            "trainer.rollout_gpus",
        ),
        (
            _all(_groups({}, {"nodes": 2}), SPLIT, _set("trainer.rollout_gpus", 1)),
            "trainer.rollout_gpus",
        ),
    ],
    "check_packing_budget": [
        (
            _set(
                "trainer.batch",
                {
                    "prompts_per_step": 8,
                    "micro_batch_size": 4,
                    "packing": True,
                    "max_tokens_per_micro_batch": 50,
                },
            ),
            "trainer.batch.max_tokens_per_micro_batch",
        )
    ],
    "check_lora_target_modules": [
        (
            _set("trainer.model.lora", {"rank": 8, "target_modules": []}),
            "trainer.model.lora.target_modules",
        )
    ],
    "check_lora_rank_servable": [
        (
            _all(_set("trainer.rollout.engine", "vllm"), _set("trainer.model.lora", {"rank": 600})),
            "trainer.model.lora.rank",
        )
    ],
    "check_trainer_specs": [
        (_set("trainer.model.path", "tiny:gpt9-h64-l2"), "trainer.model.path"),
        (_set("trainer.model.path", "tiny:qwen2-h96-l2"), "trainer.model.path"),
        (_set("trainer.model.path", "tiny:qwen2-64-2"), "trainer.model.path"),
        (_set("trainer.data.train", "synthetic:chess"), "trainer.data.train"),
        (_set("trainer.reward.function", "gsm9k"), "trainer.reward.function"),
        (_set("trainer.reward.function", "module:not-a-name"), "trainer.reward.function"),
        (
            _terms({"function": "letters_or_digits"}, {"function": "gsm9k", "weight": 0}),
            "trainer.rewards[1].function",
        ),
    ],
    "check_checkpoint_best": [
        (
            _set("trainer.checkpoint", {"dir": "ckpt", "best": {"metric": "val/avg@4"}}),
            "trainer.checkpoint.best.metric",  # no validation section
        ),
        (
            _all(_set("trainer.validation", VALIDATION), _set("trainer.checkpoint", BEST_PASS8)),
            "trainer.checkpoint.best.metric",  # pass@8 of validation.n 4
        ),
        (
            _all(_set("trainer.validation", VALIDATION), _set("trainer.checkpoint", BEST_MAJ)),
            "trainer.checkpoint.best.metric",  # letters_or_digits compares no answers
        ),
        (
            _all(
                _set("trainer.validation", VALIDATION),
                _set("trainer.checkpoint", {"best": {"metric": "val/avg@4"}}),
            ),
            "trainer.checkpoint.best",  # no checkpoint.dir
        ),
    ],
    "check_reward_secrets": [
        (
            _terms({"url": "http://127.0.0.1:9/score", "auth_secret": "REWARD_KEY"}),
            "trainer.rewards[0].auth_secret",
        )
    ],
}
CASES = [
    pytest.param(change, field, id=f"{check}-{i}")
    for check, cases in BROKEN.items()
    for i, (change, field) in enumerate(cases)
]


def test_start_up_runs_lint_checks_only():
    assert set(STARTUP_CHECKS) <= set(all_checks())


def test_every_start_up_check_has_a_broken_recipe():
    assert {check.__name__ for check in STARTUP_CHECKS} == set(BROKEN)


@pytest.mark.parametrize("change,field", CASES)
def test_start_up_refuses_what_lint_refuses(change, field, write_recipe):
    assert not [f for f in lint_loaded(load_recipe(write_recipe(BASE))) if f.severity == "error"]
    TrainJob.of(load_recipe(write_recipe(BASE)).recipe)  # the base starts
    changed = copy.deepcopy(yaml.safe_load(BASE))
    change(changed)
    loaded = load_recipe(write_recipe(yaml.safe_dump(changed), "changed.yaml"))
    errors = [f for f in lint_loaded(loaded) if f.severity == "error"]
    assert field in {f.field for f in errors}, [f.format() for f in errors]
    with pytest.raises(RlxError) as refusal:
        TrainJob.of(loaded.recipe)
    # The same words: the field, then one of lint's messages for it.
    said = str(refusal.value)
    assert "\n" not in said
    assert any(said.startswith(f"{f.field}: {f.message}") for f in errors), said


# --------------------------------------------------------------------------- lint cannot see


def _recipe(write_recipe, tmp_path: Path, **trainer: Any) -> Any:
    """BASE with these trainer fields: a recipe lint passes."""
    data = yaml.safe_load(BASE)
    data["trainer"].update(trainer)
    data["trainer"]["logging"] = {"dir": str(tmp_path / "runs"), "tensorboard": False}
    loaded = load_recipe(write_recipe(yaml.safe_dump(data), "cannot-see.yaml"))
    assert not [f for f in lint_loaded(loaded) if f.severity == "error"]
    return loaded.recipe


def test_a_model_folder_without_a_config_is_one_line(write_recipe, tmp_path):
    empty = tmp_path / "model"
    empty.mkdir()
    recipe = _recipe(write_recipe, tmp_path, model={"path": str(empty)})
    with pytest.raises(RlxError, match=rf"^trainer.model.path: {empty} has no config.json"):
        run_training(recipe, {"RLX_RUN_ID": "no-config"})


def test_a_data_file_gone_after_lint_is_lints_line(write_recipe, tmp_path):
    rows = tmp_path / "gone.jsonl"
    rows.write_text('{"prompt": "a", "answer": "1"}\n')
    recipe = _recipe(write_recipe, tmp_path, data={"train": str(rows)})
    rows.unlink()
    said = [f.format() for f in lint_loaded(load_recipe(write_recipe(_dump(recipe), "g.yaml")))]
    with pytest.raises(RlxError) as refusal:
        run_training(recipe, {"RLX_RUN_ID": "no-data"})
    line = str(refusal.value)
    assert (
        line == f"trainer.data.train: {rows} does not exist; give a .jsonl, .ndjson or "
        ".parquet file, or synthetic:letters_or_digits"
    )
    assert any(s.endswith(f"error: {line}") for s in said), said


def _dump(recipe: Any) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json", exclude_unset=True))


def test_too_few_prompts_for_a_step_is_one_line(write_recipe, tmp_path):
    rows = tmp_path / "two.jsonl"
    rows.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": "2"}\n')
    recipe = _recipe(write_recipe, tmp_path, data={"train": str(rows)})
    with pytest.raises(RlxError, match=r"^trainer.data.train: .* has 2 usable prompts, fewer"):
        run_training(recipe, {"RLX_RUN_ID": "few"})


def test_vllm_missing_on_this_machine_is_one_line(write_recipe, tmp_path, monkeypatch):
    recipe = _recipe(write_recipe, tmp_path, rollout={"engine": "vllm", "n": 4})
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name)
    )
    with pytest.raises(RlxError, match=r"^trainer.rollout.engine: vllm runs vLLM here, and vLLM"):
        run_training(recipe, {"RLX_RUN_ID": "no-vllm"})


def test_a_recipe_without_a_trainer_has_nothing_to_train(write_recipe):
    # Lint passes a recipe whose head runs its own command; rlx train has nothing to run.
    loaded = load_recipe(write_recipe("name: only-command\ncommand: [echo hi]\n"))
    assert not [f for f in lint_loaded(loaded) if f.severity == "error"]
    with pytest.raises(RlxError, match=r"^recipe 'only-command' has no 'trainer:' section"):
        TrainJob.of(loaded.recipe)
