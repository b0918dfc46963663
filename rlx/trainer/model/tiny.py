"""Tiny random causal LMs with a byte-level tokenizer, built locally.

Nothing can be downloaded in tests or in the quickstart, so this module writes a complete
model folder (config, weights, generation config, tokenizer, chat template) from scratch.
Token ids 0..255 are the raw bytes, so any UTF-8 text round-trips, and the special tokens
follow them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rlx.recipe.specs import TINY_ARCHS, TINY_HEAD_DIM, TINY_SPECIAL_TOKENS, TINY_VOCAB

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

# Byte b has token id b; the special tokens come right after the 256 byte tokens.
SPECIAL_TOKENS = TINY_SPECIAL_TOKENS
BOS_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
VOCAB_SIZE = TINY_VOCAB

# ChatML, the layout Qwen2 instruct models use; generation stops at <|im_end|>.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

ARCHS = TINY_ARCHS
# Attention head size by default: vLLM's CPU attention kernels take 64 (not 16 or 32), so
# every default tiny model also runs on vLLM's CPU build.
HEAD_DIM = TINY_HEAD_DIM


def token_id(token: str) -> int:
    """Id of a special token of the tiny tokenizer."""
    return 256 + SPECIAL_TOKENS.index(token)


def _byte_to_char() -> dict[int, str]:
    """The byte -> printable character table byte-level BPE uses (GPT-2's convention).

    Printable Latin-1 bytes stand for themselves; the others (controls, space, ...) are
    shifted to code points from 256 up so every byte has a visible, unique character.
    """
    printable = (
        set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    )
    table: dict[int, str] = {}
    shifted = 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + shifted)
            shifted += 1
    return table


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer: 256 byte tokens (id == byte value), then SPECIAL_TOKENS.

    No merges, so every byte is one token: encoding never fails and decoding is exact.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: byte for byte, char in _byte_to_char().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(
    out_dir: str | Path,
    *,
    arch: str = "qwen2",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = True,
    embedding_std: float | None = None,
    seed: int = 0,
) -> Path:
    """Write a random causal LM and its tokenizer to `out_dir`; return the folder.

    The folder loads with `AutoModelForCausalLM.from_pretrained` and
    `AutoTokenizer.from_pretrained`. The same arguments give byte-identical files.
    `num_heads` defaults to hidden_size // HEAD_DIM (one head below HEAD_DIM);
    `num_kv_heads` defaults to `num_heads` (no grouped-query attention);
    `intermediate_size` defaults to 4 * hidden_size. `embedding_std` redraws the token
    embeddings (and an untied LM head) with that standard deviation.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = _config(
        arch,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
    )
    special = _special_ids()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # A private RNG stream: building a model must not move the caller's global torch RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if embedding_std is not None:
            with torch.no_grad():
                model.get_input_embeddings().weight.normal_(0.0, embedding_std)
                if not tie_word_embeddings:
                    model.get_output_embeddings().weight.normal_(0.0, embedding_std)
    model.generation_config = GenerationConfig(**special)
    model.save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    return out


def _special_ids() -> dict[str, int]:
    return {
        "bos_token_id": token_id(BOS_TOKEN),
        "eos_token_id": token_id(EOS_TOKEN),
        "pad_token_id": token_id(PAD_TOKEN),
    }


def _config(
    arch: str,
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int | None,
    num_kv_heads: int | None,
    intermediate_size: int | None,
    max_position_embeddings: int,
    tie_word_embeddings: bool,
    **extra: object,
):
    """The transformers config of a tiny model (see build_tiny_model for the defaults)."""
    from transformers import LlamaConfig, Qwen2Config

    config_classes = {"qwen2": Qwen2Config, "llama": LlamaConfig}
    if arch not in config_classes:
        raise ValueError(f"unknown arch {arch!r}; valid: {', '.join(ARCHS)}")
    if num_heads is None:
        num_heads = max(hidden_size // HEAD_DIM, 1)
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
    kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if num_heads % kv_heads:
        raise ValueError(f"num_heads {num_heads} is not divisible by num_kv_heads {kv_heads}")
    return config_classes[arch](
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate_size or 4 * hidden_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        **_special_ids(),
        **extra,
    )


def build_tiny_reward_model(
    out_dir: str | Path,
    *,
    arch: str = "qwen2",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int | None = None,
    num_labels: int = 1,
    max_position_embeddings: int = 2048,
    chat_template: str | None = None,
    seed: int = 0,
) -> Path:
    """Write a random sequence classifier (a reward model: one label by default) and the
    byte-level tokenizer to `out_dir`; return the folder. It loads with
    `AutoModelForSequenceClassification.from_pretrained`. Its score head is drawn with a
    standard deviation of 1 / sqrt(hidden_size), so scores are of order one. chat_template:
    the tokenizer's own (ChatML when None)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    config = _config(
        arch,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=None,
        intermediate_size=None,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        num_labels=num_labels,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            model.score.weight.normal_(0.0, hidden_size**-0.5)
    model.save_pretrained(out)
    tokenizer = build_tokenizer()
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(out)
    return out
