from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlx.trainer.model.tiny import SPECIAL_TOKENS, VOCAB_SIZE, build_tiny_model, token_id


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_builds_a_folder_transformers_loads(tmp_path: Path, arch: str) -> None:
    folder = build_tiny_model(tmp_path / arch, arch=arch, hidden_size=32, num_heads=2)
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert model.config.model_type == arch
    assert model.config.vocab_size == len(tokenizer) == VOCAB_SIZE
    assert model.config.hidden_size == 32
    ids = tokenizer("hello", return_tensors="pt")["input_ids"]
    logits = model(input_ids=ids).logits
    assert logits.shape == (1, 5, VOCAB_SIZE)
    assert torch.isfinite(logits).all()


def test_same_seed_gives_identical_files_other_seed_differs(tmp_path: Path) -> None:
    first = _digests(build_tiny_model(tmp_path / "a", seed=3))
    again = _digests(build_tiny_model(tmp_path / "b", seed=3))
    other = _digests(build_tiny_model(tmp_path / "c", seed=4))
    assert first == again
    assert first["model.safetensors"] != other["model.safetensors"]


def test_building_leaves_the_global_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(tmp_path / "m", seed=9)
    assert torch.equal(torch.rand(3), expected)


def test_special_tokens_are_set(tiny_tokenizer, tiny_model_dir: Path) -> None:
    assert tiny_tokenizer.eos_token == "<|im_end|>"
    assert tiny_tokenizer.pad_token == "<|pad|>"
    assert tiny_tokenizer.bos_token == "<|endoftext|>"
    assert tiny_tokenizer.eos_token_id == token_id("<|im_end|>")
    assert len({tiny_tokenizer.eos_token_id, tiny_tokenizer.pad_token_id}) == 2
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.generation_config.eos_token_id == tiny_tokenizer.eos_token_id
    assert model.generation_config.pad_token_id == tiny_tokenizer.pad_token_id
    for token in SPECIAL_TOKENS:
        assert tiny_tokenizer.convert_tokens_to_ids(token) == token_id(token)


@pytest.mark.parametrize(
    "text",
    [
        "plain ascii",
        "naïve café",
        "中文 and 日本語",
        "emoji 🚀🔥",
        "tabs\tand\nnewlines\r\n",
        "\x00\x7f",
    ],
)
def test_tokenizer_round_trips_utf8_one_token_per_byte(tiny_tokenizer, text: str) -> None:
    ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == list(text.encode("utf-8"))
    assert tiny_tokenizer.decode(ids) == text


def test_special_token_text_is_one_token(tiny_tokenizer) -> None:
    ids = tiny_tokenizer("a<|im_end|>b", add_special_tokens=False)["input_ids"]
    assert ids == [ord("a"), token_id("<|im_end|>"), ord("b")]
    assert tiny_tokenizer.decode(ids, skip_special_tokens=True) == "ab"


def test_chat_template_renders_chatml_with_generation_prompt(tiny_tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    text = tiny_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tiny_tokenizer.apply_chat_template(messages, tokenize=False)
    assert not no_prompt.endswith("assistant\n")


def test_bad_arguments_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown arch 'gpt9'; valid: qwen2, llama"):
        build_tiny_model(tmp_path / "x", arch="gpt9")
    with pytest.raises(ValueError, match="not divisible"):
        build_tiny_model(tmp_path / "y", hidden_size=30, num_heads=4)
