"""A tiny random causal LM with a real byte-pair tokenizer, trained here.

The byte-level tokenizer of rlx's tiny models has no merges, so decoding and re-encoding
can never change an id. This one is trained with the `tokenizers` library on text where
words, numbers and punctuation run into each other, so it has merges that cross what are
turn boundaries in an episode ("?" then "7", a turn's end then an observation's start):
the tokenizer that shows whether a trajectory was rebuilt from text.
"""

from __future__ import annotations

import random
from pathlib import Path

from rlx.trainer.model.tiny import CHAT_TEMPLATE

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
WORDS = ["code", "box", "call", "tool", "the", "answer", "is", "of", "sum", "calc", "?", "=", "+"]


def training_text(lines: int, seed: int) -> list[str]:
    """Lines where words, numbers and symbols touch, with and without spaces."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        parts = []
        for _ in range(rng.randint(3, 12)):
            kind = rng.random()
            if kind < 0.4:
                parts.append(rng.choice(WORDS))
            elif kind < 0.8:
                parts.append(str(rng.randint(0, 999)))
            else:
                parts.append(rng.choice("?=+-*/()<>:#\n"))
        glue = rng.choice(["", " ", "\n"])
        out.append(glue.join(parts))
    return out


def build_bpe_model(out_dir: str | Path, vocab_size: int = 512, seed: int = 0) -> Path:
    """A random 2-layer Qwen2 (head size 64, vLLM's CPU kernels) with a byte-level BPE
    tokenizer of `vocab_size` ids, trained on training_text, and ChatML; returns the folder."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_text(4000, seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    config = Qwen2Config(
        vocab_size=len(fast),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=1,
        num_key_value_heads=1,
        intermediate_size=256,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = fast.eos_token_id
    model.generation_config.pad_token_id = fast.pad_token_id
    model.save_pretrained(out)
    return out
