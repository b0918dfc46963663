"""LoRA in the plan, by hand-worked numbers: the adapters' size (and peft's own count of
it), what they add to the activations (and what autograd really saves), vLLM's slots and
scratch, and the budgets of a LoRA recipe: the base frozen in the compute dtype, the
adapters' state in float32, no reference, pushes and checkpoints of the adapter alone."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest
from typer.testing import CliRunner

from rlx.cli import app
from rlx.plan import ModelShape, find_shape, plan_recipe
from rlx.plan import lora as sizes
from rlx.plan import memory as mem
from rlx.plan.budget import Budget, Item, adapter_compute
from rlx.plan.strategy import choose_strategy
from rlx.recipe.model import LoraSettings
from tests.conftest import RECIPES
from tests.unit.plan.test_plan import SMALL
from tests.unit.plan.test_strategy import recipe

runner = CliRunner()

# Qwen2.5-7B: hidden 3584, 28 layers, q 28 x 128 = 3584, kv 4 x 128 = 512, intermediate 18944.
# One decoder layer's linear layers, sum of (in + out): q 7168, k 4096, v 4096, o 7168,
# gate 22528, up 22528, down 22528.
QWEN7B_LINEAR = 2 * 7168 + 2 * 4096 + 3 * 22528
QWEN7B_PARAMS = 7_615_616_512


@pytest.fixture
def small() -> ModelShape:
    return ModelShape.from_config(SMALL)


def items(budget: Budget) -> dict[str, Item]:
    return {i.name: i for i in budget.items}


def named(budgets: list[Budget], start: str) -> Budget:
    (budget,) = [b for b in budgets if b.title.startswith(start)]
    return budget


# --------------------------------------------------------------------------- the adapters


def test_adapter_params_by_hand(small: ModelShape) -> None:
    # SMALL: hidden 64, q 64, kv 32, intermediate 128, 2 layers. (in + out) per layer:
    # q 128, k 96, v 96, o 128, gate 192, up 192, down 192 = 1024
    assert QWEN7B_LINEAR == 90112
    assert sizes.adapter_params(small, LoraSettings(rank=8)) == 2 * 8 * 1024
    assert sizes.adapter_params(
        small, LoraSettings(rank=4, target_modules=["q_proj", "v_proj"])
    ) == (2 * 4 * (128 + 96))
    # peft's names match at a dot: the parent's name may come along
    parents = LoraSettings(rank=2, target_modules=["self_attn.o_proj", "mlp.down_proj"])
    assert sizes.adapted_layers(small, parents.target_modules) == ("o_proj", "down_proj")
    assert sizes.adapter_params(small, parents) == 2 * 2 * (128 + 192)
    # a name that matches nothing adds nothing (lint refuses it); a repeated one counts once
    odd = LoraSettings(rank=1, target_modules=["q_proj", "qkv_proj", "q_proj"])
    assert sizes.adapter_params(small, odd) == 2 * 128
    assert sizes.unknown_targets(small, odd.target_modules) == ["qkv_proj"]
    assert sizes.unknown_targets(small, "all-linear") == []
    # the figures: 7B at rank 32 is 94x smaller than the model
    qwen7b = find_shape("Qwen/Qwen2.5-7B-Instruct", {})
    assert sizes.adapter_params(qwen7b, LoraSettings(rank=32)) == 28 * 32 * 90112 == 80_740_352
    assert QWEN7B_PARAMS // 80_740_352 == 94
    # 0.5B at rank 8: 4.4M parameters, 16.8 MiB in float32 (what a push carries)
    half = find_shape("Qwen/Qwen2.5-0.5B", {})
    assert sizes.adapter_params(half, LoraSettings(rank=8)) == 24 * 8 * 22912 == 4_399_104
    assert sizes.adapter_bytes(half, LoraSettings(rank=8)) == 4 * 4_399_104


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize(
    "targets", ["all-linear", ["q_proj", "v_proj"], ["self_attn.o_proj", "down_proj"]]
)
def test_adapter_params_are_pefts_count(arch: str, targets: Any) -> None:
    """peft's trainable parameters on a real model of SMALL's shape, a causal LM (the
    policy) and its body (the critic's), equal the plan's count."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    config = AutoConfig.for_model(arch, **{k: v for k, v in SMALL.items() if k != "model_type"})
    shape = ModelShape.from_config({**SMALL, "model_type": arch})
    lora = LoraSettings(rank=4, target_modules=targets)
    for build, task in ((AutoModelForCausalLM, "CAUSAL_LM"), (AutoModel, "FEATURE_EXTRACTION")):
        wrapped = get_peft_model(
            build.from_config(config),
            LoraConfig(r=4, target_modules=targets, task_type=task),
        )
        trained = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
        assert trained == sizes.adapter_params(shape, lora), (build.__name__, targets)


def _saved_bytes_per_token(
    base: Any, adapter: Any, *, autocast: bool, dropout: float, tokens: tuple[int, int]
) -> float:
    """What a peft-wrapped Linear(64, 64) at rank 8 saves for backward besides its
    parameters, per token: the slope between two token counts (a copy of a weight that
    autocast makes is the same for both, so it drops out)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("q_proj", nn.Linear(64, 64, bias=False, dtype=base))
    model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj"], lora_dropout=dropout))
    for name, param in model.named_parameters():
        if "lora_" in name:
            param.data = param.data.to(adapter)
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    sizes_at = []
    for count in tokens:
        x = torch.randn(count, 64, dtype=base, requires_grad=True)  # a layer's input
        seen: dict[int, int] = {}

        def pack(t: Any, seen: dict[int, int] = seen) -> Any:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        cast = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), cast:
            model(x)
        mine = x.untyped_storage().data_ptr()
        sizes_at.append(sum(n for ptr, n in seen.items() if ptr not in params and ptr != mine))
    return (sizes_at[1] - sizes_at[0]) / (tokens[1] - tokens[0])


def test_adapter_activations_are_what_autograd_saves(small: ModelShape) -> None:
    """Per adapted layer and token, by hand and as measured: A's output (rank 8) and, where
    the adapter reads its own copy of the input (64 wide), that copy."""
    pytest.importorskip("peft")
    import torch

    one = LoraSettings(rank=8, target_modules=["q_proj"])  # q_proj: 64 -> 64
    cases = [
        # (compute dtype, GPU, strategy, how the CPU emulates it, bytes per token by hand)
        ("float32", False, "single", (torch.float32, torch.float32, False), 8 * 4),
        ("bfloat16", False, "single", (torch.bfloat16, torch.float32, False), (64 + 8) * 4),
        # autocast: float32 adapters over a bf16 base run in bf16 on a cast copy
        ("bfloat16", True, "single", (torch.bfloat16, torch.float32, True), (64 + 8) * 2),
        # FSDP's mixed precision: the adapters themselves in bf16, the input as it is
        ("bfloat16", True, "fsdp", (torch.bfloat16, torch.bfloat16, True), 8 * 2),
    ]
    for compute, gpu, strategy, (base, adapter, autocast), by_hand in cases:
        dtype, copies = adapter_compute(compute, gpu, strategy)
        planned = sizes.adapter_activation_bytes_per_token(
            small, one, dtype=dtype, copies_input=copies
        )
        measured = _saved_bytes_per_token(
            base, adapter, autocast=autocast, dropout=0.0, tokens=(16, 48)
        )
        assert planned == by_hand == measured, (compute, gpu, strategy)
    # dropout: the dropped input is A's (64 wide); the plan adds its mask (1 byte an element,
    # as CUDA keeps it); CPU's dropout keeps its mask in the input's dtype (4 bytes here)
    dropped = LoraSettings(rank=8, dropout=0.1, target_modules=["q_proj"])
    planned = sizes.adapter_activation_bytes_per_token(
        small, dropped, dtype="float32", copies_input=False
    )
    assert planned == 8 * 4 + 64 * 4 + 64
    measured = _saved_bytes_per_token(
        torch.float32, torch.float32, autocast=False, dropout=0.1, tokens=(16, 48)
    )
    assert measured - (planned - 64) in (0, 64 * 4)
    # all-linear without a copy: A's output of each of the 7 layers
    every = sizes.adapter_activation_bytes_per_token(
        small, LoraSettings(rank=8), dtype="bfloat16", copies_input=False
    )
    assert every == 7 * 8 * 2
    # with a copy: + the inputs of q, k, v, gate, up (64), o (64), down (128)
    copied = sizes.adapter_activation_bytes_per_token(
        small, LoraSettings(rank=8), dtype="bfloat16", copies_input=True
    )
    assert copied == 7 * 8 * 2 + (6 * 64 + 128) * 2


# --------------------------------------------------------------------------- vLLM


def test_vllm_rank_slot_and_versions() -> None:
    slots = [sizes.vllm_lora_rank(r) for r in (1, 2, 8, 9, 32, 33, 300, 320, 512)]
    assert slots == [1, 8, 8, 16, 32, 64, 320, 320, 512]
    assert sizes.vllm_lora_rank(513) is None
    assert sizes.vllm_max_loras(recipe("grpo-async.yaml").trainer.rollout) == 2  # staleness 1


def test_vllm_slots_and_scratch_by_hand(small: ModelShape) -> None:
    # 2 adapters at slot 8, 2 layers, bf16: 2 * 8 * 2 * (7*64 + 2*64 + 2*32 + 3*128) * 2
    slots = sizes.engine_lora_slot_bytes(small, rank_slot=8, max_loras=2, dtype="bfloat16")
    assert slots == 2 * 8 * 2 * 1024 * 2
    # at tp 1 that is max_loras adapters at the slot's rank, in bf16
    assert slots == 2 * sizes.adapter_params(small, LoraSettings(rank=8)) * 2
    # tp 2: q 2 heads x 16 = 32, kv 1 head x 16 = 16, I 64 per GPU: 7*64 + 2*32 + 2*16 + 3*64
    split = sizes.engine_lora_slot_bytes(
        small, rank_slot=8, max_loras=2, dtype="bfloat16", tensor_parallel=2
    )
    assert split == 2 * 8 * 2 * (448 + 64 + 32 + 192) * 2
    # GPU: 16384 tokens x (3 slices x 8 x 4 bytes + 48 bytes of token maps)
    gpu = sizes.engine_lora_scratch_bytes(small, rank_slot=8, dtype="bfloat16", gpu=True)
    assert gpu == 16384 * (12 * 8 + 48)
    # CPU: 4096 tokens x the widest side (intermediate 128) x (8 gathered + 1) x 4 bytes
    cpu = sizes.engine_lora_scratch_bytes(small, rank_slot=8, dtype="float32", gpu=False)
    assert cpu == 4096 * 128 * (8 * 4 + 4)
    # a bf16 engine gathers in bf16 and casts to float32: 6 bytes an element
    cpu16 = sizes.engine_lora_scratch_bytes(small, rank_slot=8, dtype="bfloat16", gpu=False)
    assert cpu16 == 4096 * 128 * (8 * 6 + 4)


# --------------------------------------------------------------------------- budgets


def test_the_7b_lora_recipe_by_hand() -> None:
    plan = plan_recipe(recipe("gsm8k-lora-7b.yaml"), {})
    assert plan.fits and not plan.warnings and plan.strategy == "single"
    adapter = 80_740_352
    training = items(named(plan.gpus, "training"))
    # the base frozen in bf16, the adapters' weights, grads and AdamW moments in float32
    assert training["policy base (frozen)"].bytes == QWEN7B_PARAMS * 2
    assert training["policy LoRA weights"].bytes == adapter * 4
    assert training["policy LoRA grads"].bytes == adapter * 4
    assert training["policy LoRA optimizer (AdamW)"].bytes == adapter * 8
    # no reference copy, though kl.coef > 0, and nothing of a full model's state
    assert not {"reference", "policy weights", "policy grads"} & set(training)
    assert plan.lora["policy"]["reference"] == "the base (adapters off)"
    # checkpointed activations of 2 x 1024 tokens: the bf16 residual stream of 28 layers and
    # one layer recomputed, 230400 bytes a token, + the adapters: A's outputs 7 x 32 x 2 and
    # the copies autocast makes of the inputs of q, k, v, gate, up, o (3584) and down (18944)
    per_token = 230400 + 7 * 32 * 2 + (6 * 3584 + 18944) * 2
    assert per_token == 311744
    tokens = 2048
    act = training["activations, gradient checkpointing"]
    assert act.bytes == tokens * 28 * 3584 * 2 + tokens * per_token and act.phase == "update"
    assert training["LoRA adapters, autocast's copies"].bytes == adapter * 2
    # the engine: 1 adapter (max_staleness 0) at slot 32 beside its bf16 base
    rollout = items(named(plan.gpus, "rollout"))
    assert rollout["vLLM LoRA slots"].bytes == 1 * 32 * 28 * 90112 * 2
    assert rollout["vLLM LoRA scratch"].bytes == 16384 * (12 * 32 + 48)
    engine = int(0.85 * int(23034 / 1024 * 2**30))  # of an L4 as nvidia-smi reports it
    held = QWEN7B_PARAMS * 2 + 2 * 2**30 + rollout["vLLM LoRA slots"].bytes
    assert rollout["vLLM KV cache"].bytes == engine - held - rollout["vLLM LoRA scratch"].bytes
    # the push, the engine's copies and the checkpoint are the adapter's
    (host,) = plan.hosts
    held_host = items(host)
    assert held_host["weight push"].bytes == adapter * 4
    assert held_host["engines' received adapter"].bytes == adapter * 4
    assert held_host["engines' adapters (host)"].bytes == adapter * 2
    assert "engines' received bucket" not in held_host
    assert plan.checkpoint_bytes == 3 * adapter * 4
    assert held_host["checkpoint save/resume"].bytes == plan.checkpoint_bytes
    assert plan.export_bytes == adapter * 4 and plan.export_merged_bytes == QWEN7B_PARAMS * 2


def test_lora_sharded_replicated_and_the_root() -> None:
    # 4 L4s: 2 train, 2 generate; one node, so auto shards (FSDP)
    four = {"resources__accelerators": "L4:4", "trainer__rollout_gpus": 2}
    fsdp = plan_recipe(recipe("gsm8k-lora-7b.yaml", **four), {}, advise=False)
    assert fsdp.strategy == "fsdp"
    training = items(named(fsdp.gpus, "training"))
    assert training["policy base (frozen)"].bytes == QWEN7B_PARAMS // 2 * 2
    assert training["policy LoRA weights"].bytes == 80_740_352 // 2 * 4
    shape = find_shape("Qwen/Qwen2.5-7B-Instruct", {})
    # gathered: the root and 2 layers with their adapters (32 x 90112 each), in bf16; FSDP
    # runs the adapters in bf16 on the base's input: A's outputs only
    gathered = training["gathered params (FSDP)"].bytes
    assert gathered == (shape.root_params + 2 * (shape.layer_params + 32 * 90112)) * 2
    assert "LoRA adapters, autocast's copies" not in training
    assert "root grads, unsharded (FSDP)" not in training  # the policy's root is frozen
    # DDP: the base replicated, gradient buckets for the adapters alone
    ddp = plan_recipe(
        recipe("gsm8k-lora-7b.yaml", **four, trainer__parallel={"strategy": "ddp"}), {}
    )
    training = items(named(ddp.gpus, "training"))
    assert training["policy base (frozen)"].bytes == QWEN7B_PARAMS * 2
    assert training["policy LoRA DDP gradient buckets"].bytes == 80_740_352 * 4


def test_a_lora_critic_trains_its_adapters_and_value_head() -> None:
    # ppo-7b (8 FSDP ranks) with rank-16 adapters on the policy and rank 8 on the critic
    ppo = recipe(
        "ppo-7b.yaml",
        trainer__model__lora={"rank": 16},
        trainer__critic_model__lora={"rank": 8},
    )
    plan = plan_recipe(ppo, {}, advise=False)
    shape = find_shape("Qwen/Qwen2.5-7B-Instruct", {})
    training = items(named(plan.gpus, "training"))
    critic_adapters = 28 * 8 * 90112
    head = 3584 + 1
    assert training["critic base (frozen)"].bytes == -(-(shape.critic_params - head) // 8) * 2
    trained = critic_adapters + head
    assert training["critic LoRA and value head weights"].bytes == -(-trained // 8) * 4
    assert "reference" not in training
    # FSDP's root gradients: none of the policy's (frozen), the critic's value head:
    # bf16 grads + the float32 reduce-scatter input
    assert training["root grads, unsharded (FSDP)"].bytes == head * (2 + 4)
    policy = 28 * 16 * 90112
    assert plan.checkpoint_bytes == 3 * (policy + trained) * 4
    assert plan.lora["critic"]["trained_params"] == trained
    assert "max_lora_rank" not in plan.lora["critic"]  # only the policy is served
    # without a critic_model the critic is the policy's model, its lora included
    inherited = recipe("ppo-7b.yaml", trainer__model__lora={"rank": 16}, trainer__critic_model=None)
    assert plan_recipe(inherited, {}, advise=False).lora["critic"]["rank"] == 16


def test_lora_on_cpu_and_vllms_cpu_scratch() -> None:
    plan = plan_recipe(recipe("quickstart-lora.yaml"), {})
    (rank,) = [b for b in plan.hosts]
    shape = find_shape("tiny:qwen2-h64-l2", {})
    # tiny: hidden 64, one head of 64 (q = kv = 64), intermediate 256, 2 layers:
    # (in + out) per layer 4 x 128 + 3 x 320 = 1472
    adapter = 2 * 8 * 1472
    assert plan.lora["policy"]["adapter_params"] == adapter
    assert plan.lora["policy"]["reference"] == "none"  # kl.coef 0
    assert plan.checkpoint_bytes == 3 * adapter * 4
    assert items(rank)["checkpoint save/resume"].bytes == 3 * adapter * 4
    # vLLM's CPU build in the training process: its slots stay, its scratch comes with
    # the rollout (4096 tokens x intermediate 256 x (8 + 1) x 4 bytes)
    vllm = recipe("quickstart-lora.yaml", trainer__rollout__engine="vllm")
    from rlx.plan.budget import layout_of, training_budget

    budget = training_budget(vllm.trainer, shape, None, layout_of(vllm), "single", False, None)
    held = items(budget)
    assert held["vLLM LoRA slots (CPU)"].bytes == 1 * 8 * 2 * 1472 * 4
    assert held["vLLM LoRA slots (CPU)"].phase == "all"
    assert held["vLLM LoRA scratch (CPU)"].bytes == 4096 * 256 * 9 * 4
    assert held["vLLM LoRA scratch (CPU)"].phase == "rollout"
    assert held["policy LoRA weights"].bytes == adapter * 4
    assert held["policy base (frozen)"].bytes == shape.params * 4  # float32 on CPU


def test_offload_reference_with_lora_neither_counts_nor_chooses_fsdp() -> None:
    # gsm8k-grpo: 2 nodes x 1 L4 over TCP, where auto picks DDP
    asked = {"trainer__parallel": {"offload_reference": True}}
    full = choose_strategy(recipe("gsm8k-grpo.yaml", **asked), {})
    assert full.strategy == "fsdp" and "offload_reference" in full.reason
    lora = recipe("gsm8k-grpo.yaml", **asked, trainer__model__lora={"rank": 8})
    assert choose_strategy(lora, {}).strategy == "ddp"
    plan = plan_recipe(lora, {})
    assert all("reference" not in i.name for b in plan.gpus + plan.hosts for i in b.items)


def test_plan_says_the_reference_is_the_base() -> None:
    result = runner.invoke(app, ["plan", str(RECIPES / "gsm8k-lora-7b.yaml")])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "policy LoRA: rank 32 (alpha 64) on 7 linear layers x 28" in text
    assert "80,740,352 adapter parameters, 308.0 MiB in float32" in text
    assert "the base is frozen and is the reference (adapters off): no copy" in text
    assert "vLLM serves it at max_lora_rank 32, max_loras 1" in text
    assert "export 0.3 GiB (the adapter; merged 14.2 GiB)" in text
    data = json.loads(
        runner.invoke(app, ["plan", str(RECIPES / "gsm8k-lora-7b.yaml"), "--json"]).output
    )
    assert data["lora"]["policy"]["adapter_params"] == 80_740_352
    assert data["lora"]["policy"]["layers"][0] == "q_proj"
    assert data["export_merged_bytes"] == QWEN7B_PARAMS * 2


def test_lora_fits_where_full_training_does_not() -> None:
    # the same recipe without LoRA: the policy's float32 state alone is 4 x 28.4 GiB
    full = plan_recipe(recipe("gsm8k-lora-7b.yaml", trainer__model__lora=None), {}, advise=False)
    assert not full.fits
    assert "training GPU: needs 132.2 GiB of 22.5 GiB" in full.problems[0]
    assert mem.DTYPE_BYTES["bfloat16"] * QWEN7B_PARAMS < 23034 / 1024 * 2**30  # the base alone fits
