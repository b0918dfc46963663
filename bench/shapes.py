"""Random-init models with real architectures' shapes, for benchmarks that must run offline.

Qwen2.5-0.5B's config (hidden 896, 14 query heads, 2 key/value heads, MLP 4864, vocabulary
151936, tied embeddings) with a chosen number of layers (24 is the real model), random
weights in float32, and the byte-level tokenizer of rlx.trainer.model.tiny: token ids above its
260 are never produced by the tokenizer, but the model can sample them and decoding skips
them, so generation and rewards still run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

QWEN25_05B: dict[str, Any] = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
QWEN25_05B_LAYERS = 24


def qwen25_05b_config(layers: int) -> Any:
    """A transformers Qwen2Config: Qwen2.5-0.5B's shape with `layers` decoder layers."""
    from transformers import Qwen2Config

    from rlx.trainer.model.tiny import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, token_id

    return Qwen2Config(
        num_hidden_layers=layers,
        bos_token_id=token_id(BOS_TOKEN),
        eos_token_id=token_id(EOS_TOKEN),
        pad_token_id=token_id(PAD_TOKEN),
        **QWEN25_05B,
    )


def write_qwen25_05b(folder: Path, layers: int, seed: int = 0) -> Path:
    """Save a random-init model of that shape, its generation config and tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from rlx.trainer.model.tiny import build_tokenizer

    config = qwen25_05b_config(layers)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    return folder


def parameter_count(layers: int) -> int:
    """Parameters of the shape (tied embeddings counted once), without building it."""
    c = QWEN25_05B
    hidden, kv = c["hidden_size"], c["hidden_size"] // c["num_attention_heads"]
    kv_width = kv * c["num_key_value_heads"]
    attention = hidden * hidden + hidden + 2 * (hidden * kv_width + kv_width) + hidden * hidden
    mlp = 3 * hidden * c["intermediate_size"]
    layer = attention + mlp + 2 * hidden  # two RMSNorm weights
    return c["vocab_size"] * hidden + layers * layer + hidden  # final norm
