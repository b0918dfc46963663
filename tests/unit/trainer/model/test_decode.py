"""The HF engine's own decode step (rlx.trainer.model.decode): its logits equal
transformers' forward for every architecture it takes (grouped-query attention, per-head
norms, LoRA adapters, a model named by hub id), it samples what the forward samples, the
start-up check catches a step that is wrong, and models it cannot run go through the
forward with one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config, Qwen3Config

from rlx.recipe.model import LoraSettings
from rlx.trainer.model import cpu_linear, decode, lora
from rlx.trainer.model.attention import use_segment_attention
from rlx.trainer.model.decode import LeanDecoder
from rlx.trainer.model.tiny import build_tiny_model
from rlx.trainer.model.traits import traits
from rlx.trainer.resolve import resolve_model_path
from rlx.trainer.rollout.base import SamplingArgs
from rlx.trainer.rollout.colocated import make_colocated_engine
from rlx.trainer.rollout.hf import HFEngine
from tests.support.hub import HubCache

pytestmark = pytest.mark.timeout(300)

PROMPTS = [[10, 20, 30, 40, 50, 60, 70], [5], [100, 101, 102]]  # unequal: left padding
# float32 logits of the same ops in another order: a few units of float32's resolution at
# the logits' size (measured about 1e-7 here); a wrong position or mask is off by 1e-2 or more
LOGIT_TOLERANCE = 2e-6


def gqa_model(folder: Path, arch: str = "qwen2") -> AutoModelForCausalLM:
    """Two query heads sharing one key/value head, with embeddings and query/key weights
    drawn larger than a fresh model's: its attention then depends on where tokens are, as a
    trained model's does (at the default scale it is nearly uniform)."""
    path = build_tiny_model(
        folder, arch=arch, hidden_size=128, num_layers=2, num_kv_heads=1, embedding_std=1.0
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return model


def qwen3_model() -> AutoModelForCausalLM:
    """Qwen3's layers: per-head RMS norms on queries and keys."""
    config = Qwen3Config(
        vocab_size=260,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def gap_of(model) -> float:
    decoder, reason = LeanDecoder.for_model(model)
    assert decoder is not None, reason
    return decoder.check(model)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_the_step_equals_the_forward_with_grouped_query_attention(
    tmp_path: Path, arch: str
) -> None:
    assert gap_of(gqa_model(tmp_path / arch, arch)) <= LOGIT_TOLERANCE


@pytest.mark.parametrize("products", ["blas", "onednn", "onednn, packed"])
def test_the_step_equals_the_forward_whichever_way_the_cpu_linears_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, products: str
) -> None:
    """BLAS, oneDNN over the weights as they are, and oneDNN over weights packed for the
    generation (what a small model gets): the same logits within rounding."""
    if products != "blas" and cpu_linear._product() is None:
        pytest.skip("this torch has no oneDNN linear")
    monkeypatch.setenv(cpu_linear.ENV, products.split(",")[0])
    cpu_linear.decision.cache_clear()
    try:
        monkeypatch.setattr(decode, "PACK_LIMIT", 2**40 if "packed" in products else 0)
        model = gqa_model(tmp_path / "model")
        cpu_linear.use_onednn(model)
        decoder = LeanDecoder(model)
        assert decoder.pack == ("packed" in products)
        assert decoder.check(model) <= LOGIT_TOLERANCE
    finally:
        cpu_linear.decision.cache_clear()


def test_the_step_equals_the_forward_with_per_head_norms() -> None:
    assert gap_of(qwen3_model()) <= LOGIT_TOLERANCE


def test_the_step_equals_the_forward_with_lora_adapters(tmp_path: Path) -> None:
    """Adapters that add something (B drawn, not zero) are applied by their own forward."""
    model = lora.add_adapters(gqa_model(tmp_path / "base"), LoraSettings(rank=4))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if lora.is_adapter(name):
                param.normal_(0.0, 0.2)
    assert gap_of(model) <= LOGIT_TOLERANCE
    with model.disable_adapter():  # and the base alone, as the reference is scored
        assert gap_of(model) <= LOGIT_TOLERANCE


def test_the_step_equals_the_forward_of_a_model_that_attends_by_segments(
    tmp_path: Path,
) -> None:
    """A colocated engine decodes with the learner's policy, switched to segment attention."""
    model = gqa_model(tmp_path / "model")
    use_segment_attention(model)
    assert gap_of(model) <= LOGIT_TOLERANCE


def test_the_engine_samples_what_the_forward_samples(tmp_path: Path) -> None:
    """Same seed, same tokens, through the engine's step and through transformers' forward;
    the log-probs within float32 rounding."""
    engine = HFEngine(gqa_model(tmp_path / "model"))
    assert engine.decoder is not None and engine.decode_note is None
    sampling = SamplingArgs(4, max_new_tokens=24, min_new_tokens=2)
    lean = engine.generate(PROMPTS, sampling, seed=5)
    engine.decoder = None
    forward = engine.generate(PROMPTS, sampling, seed=5)
    assert torch.equal(lean.response_ids, forward.response_ids)
    assert torch.equal(lean.response_mask, forward.response_mask)
    assert float((lean.logprobs - forward.logprobs).abs().max()) <= 1e-5


def test_a_model_named_by_hub_id_decodes_with_the_step(
    hub_cache: HubCache, tmp_path: Path, monkeypatch
) -> None:
    """The engine's model resolved from its hub id as the trainer resolves it."""
    for name, value in hub_cache.env.items():
        monkeypatch.setenv(name, value)
    engine = HFEngine(resolve_model_path(hub_cache.repo_id, tmp_path / "models", seed=0))
    assert engine.decoder is not None, engine.decode_note
    batch = engine.generate(PROMPTS, SamplingArgs(2, max_new_tokens=8), seed=0)
    assert batch.response_mask.any(dim=1).all()


def test_the_check_catches_a_wrong_step_and_the_engine_falls_back(
    tmp_path: Path, monkeypatch
) -> None:
    """The negative control: rotary embeddings left out of the step (every position looks
    the same to attention) is far beyond rounding; the engine then decodes through the
    forward and says so in one line."""
    model = gqa_model(tmp_path / "model")
    monkeypatch.setattr(decode, "_rotate", lambda x, cos, sin: x)
    assert gap_of(model) > 1e3 * LOGIT_TOLERANCE
    engine = HFEngine(model)
    assert engine.decoder is None
    note = engine.decode_note or ""
    assert note.startswith("rollouts: the HF engine decodes through transformers' forward")
    assert "differ from the forward's" in note and "\n" not in note
    batch = engine.generate(PROMPTS, SamplingArgs(2, max_new_tokens=6), seed=0)
    assert len(batch) == 2 * len(PROMPTS)


def sliding_model() -> AutoModelForCausalLM:
    """A Qwen2 whose second layer attends to a sliding window: not one the step runs."""
    config = Qwen2Config(
        vocab_size=260,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=1,
        num_key_value_heads=1,
        use_sliding_window=True,
        sliding_window=16,
        max_window_layers=1,
        eos_token_id=1,
    )
    return AutoModelForCausalLM.from_config(config)


def test_models_it_cannot_run_say_why() -> None:
    model = sliding_model()
    assert "not full attention" in (traits(model).decode_obstacle or "")
    dynamic = Qwen2Config(
        vocab_size=260,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    )
    assert "changes with the sequence" in (
        traits(AutoModelForCausalLM.from_config(dynamic)).decode_obstacle or ""
    )
    assert "not a transformers causal LM" in (traits(torch.nn.Linear(2, 2)).decode_obstacle or "")
    windowed = MistralConfig(  # a window over every layer, as Mistral's default of 4096
        vocab_size=260,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        sliding_window=16,
    )
    assert "not full attention" in (
        traits(AutoModelForCausalLM.from_config(windowed)).decode_obstacle or ""
    )
    engine = HFEngine(model)
    assert engine.decoder is None and "not full attention" in (engine.decode_note or "")


def test_a_colocated_engine_says_once_that_it_decodes_through_the_forward() -> None:
    said: list[str] = []
    engine = make_colocated_engine(
        "hf", sliding_model(), "unused", dtype="float32", say=said.append
    )
    assert engine.engine.decoder is None  # type: ignore[attr-defined]
    assert len(said) == 1 and said[0].startswith("rollouts: the HF engine decodes through")


def test_a_sharded_model_runs_the_forward(tmp_path: Path) -> None:
    """An FSDP-sharded policy (collective engine) gathers its weights in the forward."""
    engine = HFEngine(gqa_model(tmp_path / "model"), collective=lambda flag: flag)
    assert engine.decoder is None
