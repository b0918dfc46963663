"""The plan with trainer.environment: sequences are a prompt and the longest episode
(episode_token_budget), not a prompt and one response; `rlx plan` says what it sized them by."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from typer.testing import CliRunner

from rlx.cli import app
from rlx.plan import find_shape, plan_recipe
from rlx.plan import memory as mem
from rlx.plan.budget import micro_batch_tokens, sequence_tokens
from rlx.recipe import load_recipe
from rlx.recipe.model import Recipe, TrainerSettings
from tests.conftest import RECIPES

runner = CliRunner()
TOOLS = RECIPES / "gsm8k-tools.yaml"


def _tools(tmp_path: Path, **environment: Any) -> Path:
    """gsm8k-tools with these environment fields (None removes one; environment=None in
    place of the whole section: no environment)."""
    data = yaml.safe_load(TOOLS.read_text())
    if environment.get("environment", "") is None:
        data["trainer"].pop("environment")
    else:
        for key, value in environment.items():
            if value is None:
                data["trainer"]["environment"].pop(key, None)
            else:
                data["trainer"]["environment"][key] = value
    path = tmp_path / f"tools-{len(list(tmp_path.iterdir()))}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _recipe(path: Path) -> Recipe:
    return load_recipe(path).recipe


def _trainer(recipe: Recipe) -> TrainerSettings:
    assert recipe.trainer is not None
    return recipe.trainer


def test_sequences_hold_the_longest_episode(tmp_path: Path) -> None:
    # prompt 512; max_tokens 1024 after it; without max_tokens 4 turns x 2 x 512.
    assert sequence_tokens(_trainer(_recipe(TOOLS))) == 512 + 1024
    assert sequence_tokens(_trainer(_recipe(_tools(tmp_path, max_tokens=None)))) == 512 + 4096
    assert sequence_tokens(_trainer(_recipe(_tools(tmp_path, environment=None)))) == 512 + 512


def test_micro_batches_by_hand() -> None:
    trainer = _trainer(_recipe(TOOLS))
    # 64 prompts x 8 = 512 sequences, minibatches of 128 over 2 ranks: 64 each, micro-batches
    # of 4 sequences of 512 + 1024 tokens, of which 4 x 1024 after the prompts.
    assert micro_batch_tokens(trainer, 2) == (4 * 1536, 4 * 1024)


def test_the_engines_kv_cache_counts_episodes(tmp_path: Path) -> None:
    recipe = _recipe(TOOLS)
    plan = plan_recipe(recipe, {})
    (training,) = plan.gpus
    shape = find_shape("Qwen/Qwen2.5-0.5B-Instruct", {})
    kv = next(i.bytes for i in training.items if i.name == "vLLM KV cache (colocated)")
    per_token = mem.kv_bytes_per_token(shape, dtype="bfloat16")
    assert training.engine_sequences == kv // per_token // 1536
    single = plan_recipe(_recipe(_tools(tmp_path, environment=None)), {})
    assert single.gpus[0].engine_sequences == kv // per_token // 1024
    activations = next(i for i in training.items if i.name == "activations, no checkpointing")
    assert activations.note == "6144 tokens per micro-batch"


def test_no_room_for_an_episode_names_max_tokens(tmp_path: Path) -> None:
    data = yaml.safe_load(TOOLS.read_text())
    data["trainer"]["rollout"]["gpu_memory_utilization"] = 0.12  # 2.7 GiB: weights + reserve
    path = tmp_path / "starved.yaml"
    path.write_text(yaml.safe_dump(data))
    plan = plan_recipe(_recipe(path), {}, advise=False)
    assert plan.problems == [
        "training GPU: vLLM's share (gpu_memory_utilization) leaves no room for the KV cache "
        "of one 1536-token sequence (vLLM weights (colocated) 0.9, vLLM KV cache (colocated) "
        "0.0, vLLM budget (colocated) 2.7); raise rollout.gpu_memory_utilization or "
        "tensor_parallel_size (layout: split), or shorten environment.max_tokens"
    ]


def test_rlx_plan_says_what_an_episode_may_hold(tmp_path: Path) -> None:
    result = runner.invoke(app, ["plan", str(TOOLS)])
    assert result.exit_code == 0, result.output
    assert "episodes: up to 4 turns, 1024 tokens after the prompt" in result.output.splitlines()
    one_turn = runner.invoke(app, ["plan", str(_tools(tmp_path, max_turns=1, max_tokens=None))])
    assert "episodes: up to 1 turn, 1024 tokens after the prompt" in one_turn.output.splitlines()
    plain = runner.invoke(app, ["plan", str(RECIPES / "gsm8k-grpo.yaml")])
    assert plain.exit_code == 0 and "episodes:" not in plain.output
    data = json.loads(runner.invoke(app, ["plan", str(TOOLS), "--json"]).output)
    assert (data["episode_turns"], data["episode_tokens"]) == (4, 1024)
