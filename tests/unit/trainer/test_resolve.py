from __future__ import annotations

from pathlib import Path

import pytest

from rlx.errors import RlxError
from rlx.plan.actors import plan_actors, training_groups
from rlx.recipe import parse_recipe
from rlx.trainer.actors.placement import NodeView, check_resources
from rlx.trainer.job import TrainJob
from rlx.trainer.resolve import (
    resolve_data_path,
    resolve_model_path,
    resolve_reward_fn,
    run_paths,
)
from tests.conftest import RECIPES
from tests.support.recipes import make_recipe


def test_tiny_spec_builds_once_and_deterministically(tmp_path: Path) -> None:
    first = resolve_model_path("tiny:llama-h64-l1", tmp_path / "a", seed=3)
    again = resolve_model_path("tiny:llama-h64-l1", tmp_path / "a", seed=3)
    other = resolve_model_path("tiny:llama-h64-l1", tmp_path / "b", seed=3)
    assert first == again and Path(first).name == "tiny-llama-h64-l1-seed3"
    weights = "model.safetensors"
    assert (Path(first) / weights).read_bytes() == (Path(other) / weights).read_bytes()
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["tiny-llama-h64-l1-seed3"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("tiny:qwen2-64", "is not a tiny model spec"),
        ("tiny:gpt9-h64-l2", "tiny arch 'gpt9'"),
        ("tiny:qwen2-h96-l2", "multiple of 64"),
        ("/nonexistent/model", "is not a folder"),
        ("./nowhere", "is not a folder"),
    ],
)
def test_bad_model_specs(tmp_path: Path, spec: str, message: str) -> None:
    with pytest.raises(RlxError, match=message):
        resolve_model_path(spec, tmp_path, seed=0)


def test_a_folder_without_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(RlxError, match=r"has no config\.json"):
        resolve_model_path(str(tmp_path), tmp_path / "cache", seed=0)


def test_synthetic_data_is_generated_in_the_run_folder(tmp_path: Path) -> None:
    path = resolve_data_path("synthetic:letters_or_digits", tmp_path, seed=2)
    assert path == tmp_path / "data" / "letters_or_digits-seed2.jsonl"
    assert len(path.read_text().splitlines()) == 1024
    with pytest.raises(
        RlxError,
        match="unknown synthetic task 'synthetic:poems'; valid: synthetic:letters_or_digits",
    ):
        resolve_data_path("synthetic:poems", tmp_path, seed=2)
    with pytest.raises(RlxError, match=r"trainer.data.train: /no/such.jsonl does not exist"):
        resolve_data_path("/no/such.jsonl", tmp_path, seed=2)


def test_run_paths_follow_the_run_id(tmp_path: Path) -> None:
    recipe = make_recipe(tmp_path, checkpoint={"dir": str(tmp_path / "ck")})
    paths = run_paths(recipe.name, recipe.trainer, {"SKYPILOT_TASK_ID": "sky-managed-7"})
    assert paths.run_dir == tmp_path / "runs" / "sky-managed-7"
    assert paths.checkpoints == tmp_path / "ck" / "sky-managed-7"
    assert run_paths(recipe.name, recipe.trainer, {}).run_id == "trainer-test"


def test_reward_spec_with_flexible_gsm8k(tmp_path: Path) -> None:
    recipe = make_recipe(tmp_path, reward={"function": "gsm8k", "gsm8k_mode": "flexible"})
    assert recipe.trainer is not None
    assert resolve_reward_fn(recipe.trainer)("", "so 12 and then 13", "13") == 1.0


def nodes(*gpus: float) -> list[NodeView]:
    return [NodeView(f"id{i}", f"10.0.0.{i + 1}", 2.0, g) for i, g in enumerate(gpus)]


def test_resources_short_of_the_recipe_are_one_clear_line(tmp_path: Path) -> None:
    two_nodes = parse_recipe(
        "name: big\nresources: {nodes: 2, accelerators: 'L4:1'}\ntrainer: {model: {path: x}, "
        "data: {train: y}}\n"
    ).recipe
    with pytest.raises(
        RlxError,
        match=r"asks for 2 node\(s\) with 1 GPU\(s\) each but the Ray "
        r"cluster on this machine has 1 node\(s\): 10.0.0.1 \(2 CPUs, 0 GPUs\)",
    ):
        check_resources(two_nodes, nodes(0), "on this machine")
    with pytest.raises(RlxError, match=r"check resources\.accelerators"):
        check_resources(two_nodes, nodes(1, 0), "at 10.0.0.1:6379")
    check_resources(two_nodes, nodes(1, 1, 0), "at 10.0.0.1:6379")


def test_actor_plans(tmp_path: Path) -> None:
    cpu = make_recipe(tmp_path)
    assert plan_actors(cpu).train_workers == 1 and plan_actors(cpu).rollout_workers == 0
    split = make_recipe(tmp_path, layout="split", rollout_gpus=2)
    plan = plan_actors(split)
    assert (plan.train_workers, plan.rollout_workers, plan.train_gpus) == (1, 2, 0)
    gpu = parse_recipe(
        "name: gpus\nresources: {nodes: 2, accelerators: 'H100:8'}\ntrainer: {model: {path: x}, "
        "data: {train: y}, layout: split, rollout_gpus: 4, rollout: {tensor_parallel_size: 2}}\n"
    ).recipe
    plan = plan_actors(gpu)
    assert (plan.train_workers, plan.rollout_workers, plan.rollout_gpus) == (12, 2, 2)
    # Training ranks take whole nodes: one group packed on each node's 8 GPUs, the rest
    # on a node of their own, beside the engines; on CPU one group spread over the nodes.
    assert training_groups(plan) == [8, 4]
    assert training_groups(plan_actors(split)) == [1]
    for name, groups in (("ppo-7b", [8]), ("grpo-large", [8, 8]), ("gsm8k-grpo", [1, 1])):
        shipped = parse_recipe((RECIPES / f"{name}.yaml").read_text()).recipe
        assert training_groups(plan_actors(shipped)) == groups, name


def test_batch_must_split_over_cpu_nodes(tmp_path: Path) -> None:
    recipe = parse_recipe(
        "name: cpus\nresources: {nodes: 3}\ntrainer: {model: {path: x}, data: {train: y}, "
        "rollout: {n: 4}, batch: {prompts_per_step: 2}}\n"
    ).recipe
    # The trainer's start-up refuses it with lint's own words (and before any actor starts).
    with pytest.raises(
        RlxError,
        match=r"trainer.batch.prompts_per_step: prompts_per_step x rollout.n = 8 sequences do "
        "not split evenly over 3 training workers",
    ):
        TrainJob.of(recipe)
