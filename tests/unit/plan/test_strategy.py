"""strategy: auto, decided once by rlx.plan.strategy.choose_strategy: one rank is a plain
module, an explicit strategy stays, CPU ranks shard, and across GPU nodes with no fast fabric
DDP is chosen exactly when its plan leaves the spare memory lint asks for."""

from __future__ import annotations

import json
from typing import Any

import pytest
from typer.testing import CliRunner

from rlx.cli import app
from rlx.errors import RlxError
from rlx.plan import HEADROOM, PlanError, plan_recipe
from rlx.plan.planner import size_recipe
from rlx.plan.strategy import StrategyChoice, choose_strategy
from rlx.recipe import Recipe
from tests.conftest import RECIPES
from tests.support.recipes import shipped_recipe_data

runner = CliRunner()


def recipe(source: str, **changes: Any) -> Recipe:
    """A shipped recipe with dotted fields changed (a__b=value; None removes the field)."""
    return Recipe.model_validate(shipped_recipe_data(source, **changes))


def test_one_rank_is_a_plain_module() -> None:
    one = recipe("gsm8k-grpo.yaml", resources__nodes=1, trainer__parallel={"strategy": "ddp"})
    assert choose_strategy(one, {}) == StrategyChoice("single", "one training rank: a plain module")


def test_an_explicit_strategy_stays() -> None:
    # ppo-7b asks for fsdp; even where auto would pick DDP (gsm8k), an explicit fsdp stays
    assert choose_strategy(recipe("ppo-7b.yaml"), {}) == StrategyChoice(
        "fsdp", "trainer.parallel.strategy: fsdp"
    )
    gsm8k = recipe("gsm8k-grpo.yaml", trainer__parallel={"strategy": "fsdp"})
    assert choose_strategy(gsm8k, {}).strategy == "fsdp"
    # and an explicit ddp is not second-guessed by the plan (lint says it does not fit)
    ddp = recipe("ppo-7b.yaml", trainer__parallel={"strategy": "ddp"})
    assert choose_strategy(ddp, {}).strategy == "ddp"


def test_cpu_ranks_shard_as_before() -> None:
    choice = choose_strategy(recipe("quickstart.yaml", resources__nodes=2), {})
    assert choice.strategy == "fsdp" and "CPU ranks" in choice.reason


def test_host_offload_asks_for_fsdp() -> None:
    # gsm8k-grpo would replicate; offloading to the host is what FSDP2 does, so it shards
    for field in ("offload_optimizer", "offload_reference"):
        offload = recipe("gsm8k-grpo.yaml", trainer__parallel={field: True})
        assert choose_strategy(offload, {}) == StrategyChoice(
            "fsdp", f"auto: host offload ({field}) is FSDP's"
        )


def test_ranks_on_one_node_shard() -> None:
    # grpo-async: 8 ranks on its one H100 training node (the engines have nodes of their own)
    choice = choose_strategy(recipe("grpo-async.yaml"), {})
    assert choice == StrategyChoice("fsdp", "auto: 8 ranks on one node shard the models")


def test_ranks_across_nodes_with_a_fast_fabric_shard() -> None:
    # grpo-large with auto: 16 ranks on 2 nodes joined by EFA
    auto = recipe(
        "grpo-large.yaml", resources__fabric="efa", trainer__parallel={"strategy": "auto"}
    )
    assert choose_strategy(auto, {}) == StrategyChoice(
        "fsdp", "auto: 16 ranks on 2 nodes joined by efa"
    )
    ib = recipe("gsm8k-grpo.yaml", resources__fabric="infiniband")
    assert choose_strategy(ib, {}).strategy == "fsdp"


def test_ranks_across_nodes_without_a_fabric_replicate_when_ddp_fits() -> None:
    # gsm8k-grpo: 2 L4 nodes, gradient checkpointing on; DDP fits next to vLLM
    shipped = choose_strategy(recipe("gsm8k-grpo.yaml"), {})
    assert shipped.strategy == "ddp"
    assert shipped.reason.startswith("auto: 2 ranks on 2 nodes, no fast fabric, and DDP fits (")
    # tcp names the network and is no fast fabric: the same choice
    assert choose_strategy(recipe("gsm8k-grpo.yaml", resources__fabric="tcp"), {}) == shipped


def test_ranks_across_nodes_without_a_fabric_shard_when_ddp_does_not_fit() -> None:
    # without checkpointing the replicated state and one micro-batch's activations leave
    # no 10% of the L4 spare
    heavy = recipe("gsm8k-grpo.yaml", trainer__model__gradient_checkpointing=False)
    choice = choose_strategy(heavy, {})
    assert choice.strategy == "fsdp"
    assert "but DDP needs" in choice.reason and "(keep 10% spare)" in choice.reason


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"trainer__model__gradient_checkpointing": False},
        {"trainer__batch__micro_batch_size": 2, "trainer__model__gradient_checkpointing": False},
        {"trainer__rollout__gpu_memory_utilization": 0.6},  # 12% spare: DDP
        {"trainer__rollout__gpu_memory_utilization": 0.65},  # 7% spare: FSDP
        {"resources__accelerators": "A100-80GB:1", "trainer__model__gradient_checkpointing": False},
    ],
)
def test_ddp_is_chosen_exactly_when_its_plan_keeps_the_headroom(changes: dict[str, Any]) -> None:
    auto = recipe("gsm8k-grpo.yaml", **changes)
    ddp = recipe("gsm8k-grpo.yaml", trainer__parallel={"strategy": "ddp"}, **changes)
    (training,) = plan_recipe(ddp, {}, advise=False).gpus
    assert training.headroom is not None
    expected = "ddp" if training.headroom >= HEADROOM else "fsdp"
    assert choose_strategy(auto, {}).strategy == expected
    assert plan_recipe(auto, {}, advise=False).strategy == expected  # the plan asks the same


def test_an_unknown_model_shards(tmp_path: Any) -> None:
    unknown = recipe("gsm8k-grpo.yaml", trainer__model__path="acme/secret-13b")
    choice = choose_strategy(unknown, {"HF_HOME": str(tmp_path)})
    assert choice.strategy == "fsdp" and "DDP not planned: acme/secret-13b" in choice.reason


def test_no_trainer_is_a_plan_error() -> None:
    with pytest.raises(PlanError, match="no trainer section"):
        choose_strategy(Recipe.model_validate({"name": "bare", "command": "true"}), {})


def test_rlx_plan_prints_the_choice_and_why() -> None:
    result = runner.invoke(app, ["plan", str(RECIPES / "gsm8k-grpo.yaml")])
    assert result.exit_code == 0, result.output
    assert "strategy ddp (auto: 2 ranks on 2 nodes, no fast fabric, and DDP fits" in (result.output)
    data = json.loads(
        runner.invoke(app, ["plan", str(RECIPES / "grpo-async.yaml"), "--json"]).output
    )
    assert data["strategy"] == "fsdp"
    assert data["strategy_reason"] == "auto: 8 ranks on one node shard the models"


def test_auto_sizes_are_chosen_before_the_strategy() -> None:
    # micro_batch_size: auto across two nodes with no fabric: DDP's plan needs the size the
    # job runs with; given `auto`, the rule says so in one line instead of comparing a string
    auto = recipe("gsm8k-grpo.yaml", trainer__batch__micro_batch_size="auto")
    with pytest.raises(RlxError, match=r"^trainer\.batch\.micro_batch_size: auto is chosen"):
        choose_strategy(auto, {})
    sized, sizes = size_recipe(auto, {})
    assert sizes.auto == ("micro_batch_size",)
    assert choose_strategy(sized, {}).strategy in ("ddp", "fsdp")
    assert plan_recipe(auto, {}, advise=False).strategy == choose_strategy(sized, {}).strategy
