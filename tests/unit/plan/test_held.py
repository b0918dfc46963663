"""The plan counts what the trainer holds: AdamW moments pinned on the host while a colocated
vLLM engine generates (and nothing of the sleeping engine there), no process of its own for
a colocated engine, and in the update the sleeping engine's leftovers, FSDP's unsharded root
gradients with their float32 reduce-scatter input, and the chunked logits' backward."""

from __future__ import annotations

import pytest

from rlx.plan import ModelShape, find_shape, plan_recipe, training_state_bytes
from rlx.plan import budget as bud
from rlx.plan import memory as mem
from rlx.plan.budget import GIB, Budget, Item
from tests.unit.plan.test_plan import SMALL
from tests.unit.plan.test_strategy import recipe


def items(budget: Budget) -> dict[str, Item]:
    return {i.name: i for i in budget.items}


def test_colocated_moments_wait_pinned_on_the_host() -> None:
    plan = plan_recipe(recipe("gsm8k-grpo.yaml"), {})
    shape = find_shape("Qwen/Qwen2.5-0.5B-Instruct", {})
    (training,) = plan.gpus
    (host,) = plan.hosts  # 2 nodes of 1 rank each
    state = training_state_bytes(shape, ranks=2, strategy=plan.strategy)
    held = items(host)
    assert held["optimizer moments (host, pinned)"].bytes == state["optimizer"]
    assert "vLLM weights asleep" not in held  # sleep level 2 keeps nothing on the host
    assert "rollout engine processes" not in held  # the engine runs in the training process
    # on the GPU the moments (and the freed gradients) are held in the update only
    gpu = items(training)
    assert gpu["policy optimizer (AdamW)"].phase == "update"
    assert gpu["policy grads"].phase == "update"
    rollout = sum(i.bytes for i in training.items if i.phase in ("all", "rollout"))
    assert rollout == sum(
        gpu[name].bytes
        for name in ("policy weights", "reference", "runtime (CUDA, NCCL, allocator)")
        + (("policy DDP gradient buckets",) if plan.strategy == "ddp" else ())
        + ("vLLM budget (colocated)",)
    )
    assert training.peak == max(
        rollout, sum(i.bytes for i in training.items if i.phase in ("all", "update"))
    )


def test_moments_of_policy_and_critic_and_their_shares() -> None:
    # PPO colocated on 4 GPUs of one node, FSDP: each rank pins its share of both moments
    ppo = recipe(
        "ppo-7b.yaml",
        resources__nodes=1,
        resources__accelerators="H100:4",
        trainer__layout=None,
        trainer__rollout_gpus=None,
        trainer__rollout__tensor_parallel_size=1,
        trainer__batch__minibatch_size=None,
    )
    plan = plan_recipe(ppo, {}, advise=False)
    shape = find_shape("Qwen/Qwen2.5-7B-Instruct", {})
    policy = training_state_bytes(shape, ranks=4, strategy="fsdp")["optimizer"]
    critic = training_state_bytes(shape, ranks=4, strategy="fsdp", params=shape.critic_params)[
        "optimizer"
    ]
    (host,) = plan.hosts
    assert items(host)["optimizer moments (host, pinned)"].bytes == 4 * (policy + critic)


def test_no_pinned_moments_where_nothing_moves_them() -> None:
    # split engines: the training GPUs never hold an engine; the engines keep their process
    split = plan_recipe(recipe("ppo-7b.yaml"), {})
    held = {i.name: i for b in split.hosts for i in b.items}
    assert "optimizer moments (host, pinned)" not in held
    assert held["rollout engine processes"].bytes == 4 * int(bud.HOST_ENGINE_GIB * GIB)
    # FSDP's optimizer offload keeps the moments on the host already: counted once, there
    offload = recipe("gsm8k-grpo.yaml", trainer__parallel={"offload_optimizer": True})
    plan = plan_recipe(offload, {})
    assert plan.strategy == "fsdp"  # offload is FSDP's: auto keeps it
    names = {i.name for b in plan.hosts for i in b.items}
    assert "optimizer moments (host, pinned)" not in names and "offloaded state" in names
    # HF generate shares the policy module: nothing sleeps, nothing moves
    hf = recipe("gsm8k-grpo.yaml", trainer__rollout__engine="hf")
    plan = plan_recipe(hf, {})
    names = {i.name for b in plan.hosts + plan.gpus for i in b.items}
    assert "optimizer moments (host, pinned)" not in names
    assert "vLLM asleep (colocated)" not in names


def test_the_sleeping_engine_stays_in_the_update() -> None:
    (training,) = plan_recipe(recipe("gsm8k-tools.yaml"), {}).gpus
    asleep = items(training)["vLLM asleep (colocated)"]
    assert asleep.bytes == int(bud.VLLM_ASLEEP_GIB * GIB) and asleep.phase == "update"
    assert "estimate" in asleep.note


def test_root_gradients_by_hand() -> None:
    small = ModelShape.from_config(SMALL)
    # root: embeddings 100*64, final norm 64, untied head 100*64 = 12864 parameters
    bf16 = mem.root_grad_bytes(small, strategy="fsdp", ranks=4, dtype="bfloat16")
    assert bf16 == 12864 * (2 + 4)  # bf16 gradients and their fp32 reduce-scatter input
    assert mem.root_grad_bytes(small, strategy="fsdp", ranks=4, dtype="float32") == 12864 * 4
    assert mem.root_grad_bytes(small, strategy="ddp", ranks=4, dtype="bfloat16") == 0
    assert mem.root_grad_bytes(small, strategy="fsdp", ranks=1, dtype="bfloat16") == 0
    # the critic's root: embeddings, final norm and a value head of 64 + 1
    critic = mem.root_grad_bytes(
        small, strategy="fsdp", ranks=4, dtype="bfloat16", params=small.critic_params
    )
    assert critic == (6400 + 64 + 65) * 6


def test_root_gradients_at_7b_and_32b() -> None:
    # about 2.2 + 4.4 GB at 7B (untied head), 3.1 + 6.2 GB at 32B
    for source, shape_name, gb in (
        ("ppo-7b.yaml", "Qwen/Qwen2.5-7B-Instruct", 6.5),
        ("grpo-large.yaml", "Qwen/Qwen2.5-32B-Instruct", 9.3),
    ):
        (training, _) = plan_recipe(recipe(source), {}).gpus
        root = items(training)["root grads, unsharded (FSDP)"]
        shape = find_shape(shape_name, {})
        assert root.bytes == shape.root_params * 6 and root.phase == "update"
        assert root.bytes / 1e9 == pytest.approx(gb, abs=0.1)


def test_logits_backward_at_20_bytes_per_element() -> None:
    (training,) = plan_recipe(recipe("gsm8k-grpo.yaml"), {}).gpus
    shape = find_shape("Qwen/Qwen2.5-0.5B-Instruct", {})
    chunk = mem.logits_chunk_tokens(shape)
    assert items(training)["logits peak"].bytes == chunk * shape.vocab * 20
