"""`rlx plan`: the memory arithmetic by hand-worked numbers, the model and accelerator
tables, and the verdict through the command line and lint."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlx.cli import app
from rlx.plan import ModelShape, PlanError, find_shape, plan_recipe, training_state_bytes
from rlx.plan import memory as mem
from rlx.recipe import load_recipe
from tests.conftest import RECIPES
from tests.support.recipes import write_shipped_variant

runner = CliRunner()
GIB = 2**30
# ppo-7b on its preferred GPU alone: lint's words for a recipe with one accelerator
ONE_GPU = "H100:8"

# hidden 64, 2 layers, 4 heads of 16, 2 kv heads, intermediate 128, vocab 100, untied,
# q/k/v bias (qwen2).
SMALL = {
    "model_type": "qwen2",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 100,
    "tie_word_embeddings": False,
}


@pytest.fixture
def small() -> ModelShape:
    return ModelShape.from_config(SMALL)


def test_parameter_counts_by_hand(small: ModelShape) -> None:
    # layer: q 64*64 + k, v 2*64*32 + o 64*64 = 12288, bias 64 + 2*32 = 128,
    # MLP 3*64*128 = 24576, norms 2*64 = 128: 37120
    assert small.layer_params == 37120
    # embeddings 100*64 + final norm 64 + untied head 100*64
    assert small.root_params == 12864
    assert small.params == 2 * 37120 + 12864 == 87104
    # the critic drops the LM head and adds a value head of 64 + 1
    assert small.critic_params == 87104 - 6400 + 65


def test_parameter_counts_match_the_published_models() -> None:
    assert find_shape("Qwen/Qwen2.5-7B-Instruct", {}).params == 7_615_616_512
    assert find_shape("Qwen/Qwen2.5-0.5B", {}).params == 494_032_768
    assert find_shape("meta-llama/Llama-3.1-8B-Instruct", {}).params == 8_030_261_248


def test_training_state_by_hand(small: ModelShape) -> None:
    fsdp = training_state_bytes(small, ranks=4, strategy="fsdp")
    # 87104 / 4 = 21776 parameters per rank, 4 bytes each
    assert fsdp["weights"] == fsdp["grads"] == 21776 * 4
    assert fsdp["optimizer"] == 2 * 21776 * 4
    assert fsdp["ddp_buckets"] == 0 and fsdp["device"] == 4 * 21776 * 4 and fsdp["host"] == 0
    ddp = training_state_bytes(small, ranks=4, strategy="ddp")
    assert ddp["weights"] == ddp["ddp_buckets"] == 87104 * 4
    assert ddp["device"] == 5 * 87104 * 4
    with pytest.raises(ValueError, match="choose_strategy"):  # auto is decided before
        training_state_bytes(small, ranks=4, strategy="auto")
    single = training_state_bytes(small, ranks=1, strategy="fsdp")  # one rank: no sharding
    assert single["weights"] == 87104 * 4 and single["ddp_buckets"] == 0
    offloaded = training_state_bytes(small, ranks=4, strategy="fsdp", offload_optimizer=True)
    assert offloaded["device"] == 0 and offloaded["host"] == fsdp["device"]
    bf16 = training_state_bytes(small, ranks=2, strategy="fsdp", param_dtype="bfloat16")
    assert bf16["weights"] == 43552 * 2


def test_activation_logits_and_cache_by_hand(small: ModelShape) -> None:
    # per token and layer, q = 4 heads x 16: 2*(2*64 + 5*64 + 4*128) + 8*64 = 2432 bytes
    assert mem.layer_activation_bytes_per_token(small, "bfloat16") == 2432
    # a float32 residual stream (autocast over float32 weights): + the two norms'
    # normalised float32 products, 2*64*4
    assert mem.layer_activation_bytes_per_token(small, "bfloat16", "float32") == 2432 + 512
    plain = mem.activation_bytes(
        small, 10, dtype="bfloat16", residual_dtype="bfloat16", checkpointing=False
    )
    assert plain == 10 * 2 * 2432
    # checkpointed: the residual stream of each layer, 10*2*64*2, plus one layer recomputed
    ckpt = mem.activation_bytes(
        small, 10, dtype="bfloat16", residual_dtype="bfloat16", checkpointing=True
    )
    assert ckpt == 2560 + 24320
    # one chunk of 4 tokens in the backward: bf16 logits and their gradient, fp32 logits,
    # log-softmax and both gradients, 4*100*(2*2 + 16)
    assert mem.logits_peak_bytes(small, 8, dtype="bfloat16", chunk_tokens=4) == 8000
    assert mem.logits_peak_bytes(small, 8, dtype="bfloat16", chunk_tokens=None) == 16000
    assert mem.logits_chunk_tokens(small) == (1 << 28) // 400
    # K and V, 2 layers, 2 kv heads of 16, 2 bytes; kv heads split over tensor parallel GPUs
    assert mem.kv_bytes_per_token(small, dtype="bfloat16") == 256
    assert mem.kv_bytes_per_token(small, dtype="bfloat16", tensor_parallel=2) == 128
    assert mem.kv_bytes_per_token(small, dtype="bfloat16", tensor_parallel=4) == 128
    gathered = mem.gathered_params_bytes(
        small, strategy="fsdp", ranks=4, dtype="bfloat16", reshard_after_forward=True
    )
    assert gathered == (12864 + 2 * 37120) * 2
    assert mem.checkpoint_bytes(87104, 80769, param_dtype="float32") == 3 * 167873 * 4


def test_ddp_at_7b_is_the_figure_the_code_implies() -> None:
    # ppo-7b replicated on every GPU: policy and critic with DDP buckets, bf16 reference.
    shape = find_shape("Qwen/Qwen2.5-7B-Instruct", {})
    policy = training_state_bytes(shape, ranks=16, strategy="ddp")
    critic = training_state_bytes(shape, ranks=16, strategy="ddp", params=shape.critic_params)
    total = policy["device"] + critic["device"] + shape.params * 2
    assert 287 * GIB < total < 289 * GIB


def test_model_shapes_from_folder_cache_and_table(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(SMALL))
    assert find_shape(str(folder), {}).params == 87104
    snapshot = tmp_path / "hf" / "hub" / "models--acme--small" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(SMALL))
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("abc123")  # the main revision
    assert find_shape("acme/small", {"HF_HOME": str(tmp_path / "hf")}).params == 87104
    assert find_shape("Qwen/Qwen2.5-32B-Instruct", {}).layers == 64
    assert find_shape("tiny:qwen2-h64-l2", {}).vocab == 260
    with pytest.raises(PlanError, match=r"no config\.json found"):
        find_shape("acme/unknown-9b", {"HF_HOME": str(tmp_path / "none")})


@pytest.mark.parametrize(
    ("model", "near"),
    [
        ("Qwen/Qwen2.5-05B", "Qwen/Qwen2.5-0.5B"),  # a dot left out
        ("Qwen/Qwen 2.5-0.5B", "Qwen/Qwen2.5-0.5B"),  # a space put in
        ("qwen/qwen3-4", "Qwen/Qwen3-4B"),
        ("meta-llama/Llama3.1-8B", "meta-llama/Llama-3.1-8B"),
        ("meta-llama/Llama-2-7b-hf", None),  # another family and size, not a typo
        ("mistralai/Mistral-7B-v0.1", None),
    ],
)
def test_a_model_missing_from_the_table_names_the_row_it_nearly_is(
    model: str, near: str | None, tmp_path: Path
) -> None:
    with pytest.raises(PlanError) as refusal:
        find_shape(model, {"HF_HOME": str(tmp_path / "none")})
    said = str(refusal.value)
    assert said.startswith(f"{model}: no config.json found")
    if near is None:
        assert "did you mean" not in said
    else:
        assert f"not in the built-in table (did you mean {near!r}?); fetch it once" in said
    assert find_shape(near or "Qwen/Qwen2.5-0.5B", {}).params > 0  # the row is there


def test_the_fetch_command_for_a_model_pastes_as_one_id(tmp_path: Path) -> None:
    with pytest.raises(PlanError) as refusal:
        find_shape("acme/my model", {"HF_HOME": str(tmp_path / "none")})
    assert "(hf download 'acme/my model' config.json)" in str(refusal.value)


def test_a_model_in_a_store_gets_no_hub_advice(tmp_path: Path) -> None:
    with pytest.raises(PlanError) as refusal:
        find_shape("s3://acme-models/my-policy", {"HF_HOME": str(tmp_path / "none")})
    said = str(refusal.value)
    assert said.startswith("s3://acme-models/my-policy: a model in a store"), said
    assert "hf download" not in said and "local copy of that folder" in said


def test_shapes_know_the_models_positions() -> None:
    # What lint checks an episode against (the built tiny model's: the test below).
    assert find_shape("tiny:qwen2-h64-l2", {}).max_positions == 2048
    assert find_shape("Qwen/Qwen2.5-0.5B-Instruct", {}).max_positions == 32768
    assert find_shape("meta-llama/Meta-Llama-3-8B-Instruct", {}).max_positions == 8192
    assert find_shape("meta-llama/Llama-3.1-8B-Instruct", {}).max_positions == 131072
    config = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "vocab_size": 100,
    }
    assert ModelShape.from_config(config).max_positions is None
    positions = ModelShape.from_config({**config, "max_position_embeddings": 4096})
    assert positions.max_positions == 4096


def test_qwen3_is_planned_offline(tmp_path: Path) -> None:
    # the built-in table: each model's config.json, head_dim 128 whatever hidden / heads is
    offline = {"HF_HOME": str(tmp_path / "empty")}
    small = find_shape("Qwen/Qwen3-0.6B", offline)
    assert (small.hidden, small.layers, small.heads, small.kv_heads) == (1024, 28, 16, 8)
    assert (small.head_dim, small.intermediate, small.vocab) == (128, 3072, 151936)
    assert small.tie_word_embeddings and small.max_positions == 40960
    assert small.source == "built-in table (qwen3-0.6b)"
    params = {
        size: find_shape(f"Qwen/Qwen3-{size}", offline).params / 1e9
        for size in ("0.6B", "1.7B", "4B", "8B", "14B", "32B")
    }
    # the model cards' counts (0.6B, 1.7B, 4.0B, 8.2B, 14.8B, 32.8B), q/k norms aside
    assert [round(p, 1) for p in params.values()] == [0.6, 1.7, 4.0, 8.2, 14.8, 32.8]
    assert not find_shape("Qwen/Qwen3-8B", offline).tie_word_embeddings
    path = write_shipped_variant(tmp_path, "gsm8k-grpo.yaml", trainer__model__path="Qwen/Qwen3-4B")
    result = runner.invoke(app, ["plan", str(path)], env=offline)
    assert "Qwen/Qwen3-4B: 4.02B params (hidden 2560, 36 layers, 32/8 heads" in result.output


def test_tiny_shape_matches_the_built_tiny_model(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from rlx.trainer.resolve import resolve_model_path

    # The very folder the trainer builds for the spec (2 heads of 64, 4x MLP, tied head).
    folder = resolve_model_path("tiny:qwen2-h128-l2", tmp_path, seed=0)
    built = find_shape(folder, {})
    assert dataclasses.replace(built, source="tiny spec") == find_shape("tiny:qwen2-h128-l2", {})
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == built.params


def test_logits_chunk_is_the_trainers(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from rlx.trainer.learn.scoring import ResponseScorer
    from rlx.trainer.resolve import resolve_model_path

    folder = resolve_model_path("tiny:qwen2-h64-l1", tmp_path, seed=0)
    scorer = ResponseScorer(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32))
    assert scorer.chunk_tokens == mem.logits_chunk_tokens(find_shape("tiny:qwen2-h64-l1", {}))


def test_accelerator_table_uses_the_recipe_names() -> None:
    # the memory the devices report, not the makers' GB read as GiB
    assert mem.accelerator_gib("H100") == 79.18  # CUDA's total memory, measured on one
    assert mem.accelerator_gib("a100-80gb") == 80  # nvidia-smi: 81920 MiB
    assert mem.accelerator_gib("A100") == 40
    assert round(mem.accelerator_gib("H200") or 0, 1) == 140.4  # nvidia-smi: 143771 MiB
    assert mem.accelerator_gib("L4") == 23034 / 1024  # 22.49, not 24
    assert mem.accelerator_gib("A10G") == 23028 / 1024
    assert mem.accelerator_gib("TPU-v9") is None


# --------------------------------------------------------------------------- recipes


@pytest.mark.parametrize("recipe", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_recipes_fit(recipe: Path) -> None:
    result = runner.invoke(app, ["plan", str(recipe)])
    assert result.exit_code == 0, result.output
    assert "fits" in result.output and "does not fit" not in result.output
    plan = plan_recipe(load_recipe(recipe).recipe, {})
    assert plan.fits and not plan.warnings
    for budget in plan.gpus + plan.hosts:  # at least 10% spare wherever a limit is known
        assert budget.headroom is None or budget.headroom >= 0.10, budget.title


def test_plan_json() -> None:
    result = runner.invoke(app, ["plan", str(RECIPES / "grpo-large.yaml"), "--json"])
    assert result.exit_code == 0
    data = json.loads(result.output)
    assert data["fits"] is True and data["strategy"] == "fsdp" and data["train_ranks"] == 16
    training, rollout = data["gpus"]
    names = {item["name"] for item in training["items"]}
    assert {"policy weights", "policy grads", "policy optimizer (AdamW)", "reference"} <= names
    assert {"activations, no checkpointing", "activations, gradient checkpointing"} <= names
    assert "logits peak" in names
    assert rollout["title"].startswith("rollout GPU") and rollout["fits"]


def _variant(tmp_path: Path, source: str, **changes: object) -> Path:
    return write_shipped_variant(tmp_path, source, **changes)


def _lint_errors(path: Path) -> list[str]:
    result = runner.invoke(app, ["lint", str(path)])
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    return [line for line in result.output.splitlines() if ": error: " in line]


def test_ddp_at_7b_on_80gb_fails_lint_with_the_numbers(tmp_path: Path) -> None:
    path = _variant(
        tmp_path, "ppo-7b.yaml", trainer__parallel__strategy="ddp", resources__accelerators=ONE_GPU
    )
    (error,) = _lint_errors(path)
    assert "does not fit: training GPU: needs 296.0 GiB of 79.2 GiB" in error
    assert "parallel.strategy: fsdp" in error
    result = runner.invoke(app, ["plan", str(path)])
    assert result.exit_code == 1 and "does not fit" in result.output


def test_32b_on_l4s_fails_lint_with_the_numbers(tmp_path: Path) -> None:
    path = _variant(tmp_path, "grpo-large.yaml", resources__accelerators="L4:8")
    (error,) = _lint_errors(path)
    assert "needs 58.5 GiB of 22.5 GiB" in error and "policy optimizer (AdamW) 15.3" in error


def test_colocated_tensor_parallel_fails_lint(tmp_path: Path) -> None:
    path = _variant(tmp_path, "ppo-7b.yaml", trainer__layout=None, trainer__rollout_gpus=None)
    errors = _lint_errors(path)
    assert any(
        "trainer.rollout.tensor_parallel_size: tensor_parallel_size 2 needs layout: split" in e
        for e in errors
    )


def test_unknown_model_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    path = _variant(tmp_path, "gsm8k-grpo.yaml", trainer__model__path="acme/secret-13b")
    result = runner.invoke(app, ["plan", str(path)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "acme/secret-13b: no config.json found" in result.output
    lint = runner.invoke(app, ["lint", str(path)])
    assert lint.exit_code == 0 and "warning: trainer.model.path: memory not checked" in lint.output


def test_unknown_accelerator_is_one_line(tmp_path: Path) -> None:
    path = _variant(tmp_path, "gsm8k-grpo.yaml", resources__accelerators="TPU-v9:1")
    result = runner.invoke(app, ["plan", str(path)])
    assert result.exit_code == 1 and "no memory size in the plan's table" in result.output


def test_tight_plan_is_a_warning(tmp_path: Path) -> None:
    # ppo-7b with every rollout GPU given to vLLM: no headroom left on them.
    path = _variant(
        tmp_path,
        "ppo-7b.yaml",
        trainer__rollout__gpu_memory_utilization=0.95,
        resources__accelerators=ONE_GPU,
    )
    result = runner.invoke(app, ["lint", "--strict", str(path)])
    assert result.exit_code == 1 and "warning: resources.accelerators: tight: rollout GPU" in (
        result.output
    )


def test_math_exact_on_math_data_warns(tmp_path: Path) -> None:
    path = _variant(tmp_path, "grpo-large.yaml", trainer__reward__function="math_exact")
    result = runner.invoke(app, ["lint", str(path)])
    assert result.exit_code == 0
    assert "warning: trainer.reward.function: math_exact scores 1 only when the WHOLE" in (
        result.output
    )


def test_host_memory_too_small_fails_lint(tmp_path: Path) -> None:
    path = _variant(
        tmp_path, "ppo-7b.yaml", resources__memory="100", resources__accelerators=ONE_GPU
    )
    errors = _lint_errors(path)
    assert any(
        "resources.memory: does not fit: host RAM per node: needs 202.3 GiB of 93.1 GiB" in e
        and "resources.memory: '218+'" in e
        for e in errors
    ), errors


def test_a_split_push_holds_two_buckets_not_the_model(tmp_path: Path) -> None:
    # ppo-7b's largest tensor, the embedding (152064 x 3584 in bf16), is over the default
    # 256 MiB bucket, so it sets the bucket; a 4 GiB bucket setting sets it instead.
    embedding = 152064 * 3584 * 2
    for bucket_mb, bucket in ((None, embedding), (4096, 4 * GIB)):
        changes = (
            {} if bucket_mb is None else {"trainer__rollout__weight_sync_bucket_mb": bucket_mb}
        )
        plan = plan_recipe(load_recipe(_variant(tmp_path, "ppo-7b.yaml", **changes)).recipe, {})
        items = {i.name: i.bytes for budget in plan.hosts for i in budget.items}
        assert items["weight push"] == 2 * bucket
        assert items["engines' received bucket"] == 4 * bucket  # 4 engines on their node
    # With rollouts ahead a push waits whole behind the engines' rollouts: one bf16 copy.
    ahead = _variant(tmp_path, "ppo-7b.yaml", trainer__rollout__max_staleness=1)
    recipe = load_recipe(ahead).recipe
    plan = plan_recipe(recipe, {})
    pushes = [i for budget in plan.hosts for i in budget.items if i.name == "weight push"]
    copy = mem.engine_weight_bytes(find_shape(recipe.trainer.model.path), dtype="bfloat16")
    assert pushes and all(i.bytes == copy and "queued" in i.note for i in pushes)


def test_cpu_kv_cache_is_sized_per_token_as_the_plan_counts(tmp_path: Path) -> None:
    from rlx.recipe import parse_recipe
    from rlx.trainer.resolve import resolve_model_path
    from rlx.trainer.rollout.vllm_options import cpu_kv_cache_bytes

    folder = resolve_model_path("tiny:qwen2-h64-l2", tmp_path, seed=0)
    recipe = parse_recipe(
        "name: kv\ntrainer:\n  model: {path: 'tiny:qwen2-h64-l2'}\n"
        "  data: {train: 'synthetic:letters_or_digits', max_prompt_length: 64}\n"
        "  rollout: {n: 16, max_new_tokens: 64}\n  batch: {prompts_per_step: 64}\n"
    ).recipe
    # 2 (K, V) x 2 layers x 1 head x 64 dims x 4 bytes = 1 KiB per token; 64 x 16 sequences
    # of 128 tokens, twice over.
    assert cpu_kv_cache_bytes(recipe.trainer, folder) == 2 * 64 * 16 * 128 * 1024


def test_rlx_plan_on_l4s_uses_the_memory_they_report() -> None:
    # gsm8k-grpo asks for L4s: 23034 MiB as nvidia-smi reports them, 22.5 GiB, not 24
    result = runner.invoke(app, ["plan", str(RECIPES / "gsm8k-grpo.yaml")])
    assert result.exit_code == 0, result.output
    assert "training GPU (x2): " in result.output and " of 22.5 GiB at " in result.output


def test_engines_are_planned_in_rollout_dtype(tmp_path: Path) -> None:
    """rollout.dtype sets what the engines hold (weights, KV cache, the pushed copy), as the
    trainer loads them: a float32 engine beside the bf16 learner holds twice the bytes."""

    def engine_items(dtype: str | None) -> dict[str, int]:
        changes = {} if dtype is None else {"trainer__rollout__dtype": dtype}
        plan = plan_recipe(load_recipe(_variant(tmp_path, "ppo-7b.yaml", **changes)).recipe, {})
        rollout = next(b for b in plan.gpus if b.title.startswith("rollout GPU"))
        return {i.name: i.bytes for i in rollout.items}

    default, wide = engine_items(None), engine_items("float32")
    assert default == engine_items("bfloat16")  # the model's dtype on GPUs: bf16
    assert wide["vLLM weights"] == 2 * default["vLLM weights"]
    assert wide["vLLM KV cache"] < default["vLLM KV cache"]  # less left for the cache


def test_dynamic_sampling_is_planned_as_rounds_of_generation() -> None:
    """filter_groups: up to max_rounds generate calls a step, every round's rollouts held on
    the head until the step's groups are picked; without it one call and nothing more."""
    dapo = plan_recipe(load_recipe(RECIPES / "gsm8k-dapo.yaml").recipe, {})
    plain = plan_recipe(load_recipe(RECIPES / "gsm8k-grpo.yaml").recipe, {})
    assert dapo.generation is not None and plain.generation is not None
    assert (dapo.generation.rounds, plain.generation.rounds) == (4, 1)
    samples = 64 * 8  # prompts_per_step x rollout.n
    assert dapo.generation.samples == samples
    head = {i.name: i for i in dapo.hosts[0].items}
    held = head["rollouts of every sampling round"]
    assert held.bytes == 4 * samples * dapo.generation.tokens * (8 + 4 + 4 + 1)
    assert all(i.name != held.name for b in plain.hosts for i in b.items)
    result = runner.invoke(app, ["plan", str(RECIPES / "gsm8k-dapo.yaml")])
    assert "dynamic sampling: up to 4 calls a step (2,048 samples" in result.output
    data = json.loads(
        runner.invoke(app, ["plan", str(RECIPES / "gsm8k-dapo.yaml"), "--json"]).output
    )
    assert data["generation"]["rounds"] == 4 and data["generation"]["samples"] == samples
