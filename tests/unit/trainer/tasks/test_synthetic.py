from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlx.trainer.rollout.base import SamplingArgs
from rlx.trainer.tasks.rewards import resolve_reward, score
from rlx.trainer.tasks.synthetic import (
    CHARSETS,
    MIN_CHARS,
    arithmetic_rows,
    letters_or_digits_prompt,
    letters_or_digits_reward,
    write_arithmetic_dataset,
    write_synthetic_dataset,
)


@pytest.mark.parametrize(
    ("response", "kind", "expected"),
    [
        ("0123456789" * 2, "digits", 1.0),
        ("0123456789" * 2, "letters", 0.0),
        ("abcdefghijklmnop", "letters", 1.0),
        ("abcdefgh12345678", "letters", 0.5),
        ("abcdefgh12345678", "digits", 0.5),
        ("ABCDEFGHIJKLMNOP", "letters", 0.0),  # lowercase only
        ("7", "digits", 1 / MIN_CHARS),  # stopping early does not pay
        ("", "digits", 0.0),
        ("a" * 40, "letters", 1.0),
    ],
)
def test_reward_hand_worked(response: str, kind: str, expected: float) -> None:
    assert letters_or_digits_reward("", response, kind) == pytest.approx(expected)


def test_reward_reads_the_kind_from_the_prompt_without_an_answer() -> None:
    templated = f"<|im_start|>user\n{letters_or_digits_prompt('digits')}<|im_end|>\n"
    assert letters_or_digits_reward(templated, "1" * 16, None) == 1.0
    with pytest.raises(ValueError, match="names none of: digits, letters"):
        letters_or_digits_reward("Write poems.", "x", None)
    with pytest.raises(ValueError, match="answer 'poems' is not one of"):
        letters_or_digits_reward("", "x", "poems")


def test_reward_is_in_the_table() -> None:
    fn = resolve_reward("letters_or_digits")
    assert score(fn, ["p", "p"], ["1" * 16, "a" * 16], ["digits", "digits"]) == [1.0, 0.0]


def test_dataset_rows(tmp_path: Path) -> None:
    path = write_synthetic_dataset(tmp_path / "sub" / "train.jsonl", 200, seed=0)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 200
    assert all(set(row) == {"prompt", "answer"} for row in rows)
    assert all(row["prompt"] == letters_or_digits_prompt(row["answer"]) for row in rows)
    counts = {kind: sum(row["answer"] == kind for row in rows) for kind in CHARSETS}
    assert min(counts.values()) > 60  # both kinds well represented


def test_arithmetic_rows_are_correct_and_deterministic(tmp_path: Path) -> None:
    rows = arithmetic_rows(50, seed=4)
    assert rows == arithmetic_rows(50, seed=4) != arithmetic_rows(50, seed=5)
    for row in rows:
        expression = row["prompt"].removeprefix("What is ").split("?")[0]
        a, op, b = expression.split()
        assert int(row["answer"]) == (int(a) + int(b) if op == "+" else int(a) - int(b))
        assert "####" in row["prompt"]
    with pytest.raises(ValueError, match=r"use a \.jsonl or \.parquet file name"):
        write_arithmetic_dataset(tmp_path / "a.csv", 3, seed=0)


def _chat_prompt_ids(tokenizer, kind: str) -> list[int]:
    messages = [{"role": "user", "content": letters_or_digits_prompt(kind)}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_random_policy_scores_low(tiny_model_dir: Path, tiny_tokenizer) -> None:
    from rlx.trainer.rollout.hf import HFEngine

    engine = HFEngine(tiny_model_dir)
    kinds = sorted(CHARSETS)
    prompts = [_chat_prompt_ids(tiny_tokenizer, kind) for kind in kinds]
    batch = engine.generate(prompts, SamplingArgs(64, max_new_tokens=32), seed=0)
    texts = [tiny_tokenizer.decode(r, skip_special_tokens=True) for r in batch.response_lists()]
    answers = [kind for kind in kinds for _ in range(64)]
    mean = sum(score(letters_or_digits_reward, [""] * len(texts), texts, answers)) / len(texts)
    # 10 digits or 26 letters out of 260 tokens: about 0.07 on average
    assert 0.03 < mean < 0.12


def test_plain_grpo_learns_the_task_in_a_few_dozen_steps(tmp_path: Path) -> None:
    """The task's promise: GRPO on a tiny random model lifts the reward well above chance.

    50 steps of 4 prompts x 16 samples x 32 tokens, Adam at 2e-3, on-policy REINFORCE with
    group-normalised advantages (the GRPO loss at ratio 1).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlx.trainer.model.tiny import build_tiny_model
    from rlx.trainer.rollout.hf import HFEngine
    from rlx.trainer.tasks.data import PromptSampler, load_prompt_dataset

    folder = build_tiny_model(tmp_path / "model", seed=1)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    data = load_prompt_dataset(
        write_synthetic_dataset(tmp_path / "train.jsonl", 128, seed=1),
        tokenizer,
        answer_key="answer",
        chat_template_for_strings=True,
    )
    sampler = PromptSampler(len(data), batch_size=4, seed=1)
    engine = HFEngine(model)  # shares the policy's weights: no weight push needed
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    n = 16
    mean_rewards = []
    for step in range(50):
        rows = next(sampler)
        batch = engine.generate(
            [data.prompt_token_ids[i] for i in rows], SamplingArgs(n, max_new_tokens=32), seed=step
        )
        texts = [tokenizer.decode(r, skip_special_tokens=True) for r in batch.response_lists()]
        answers = [data.answers[i] for i in rows for _ in range(n)]
        rewards = torch.tensor(score(letters_or_digits_reward, texts, texts, answers)).view(-1, n)
        advantages = (rewards - rewards.mean(1, keepdim=True)) / (
            rewards.std(1, keepdim=True) + 1e-6
        )
        mean_rewards.append(rewards.mean().item())

        width = max(len(p) for p in batch.prompt_ids)
        prompt_ids = torch.full((len(batch), width), batch.pad_token_id)
        prompt_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, ids in enumerate(batch.prompt_ids):
            prompt_ids[row, width - len(ids) :] = torch.tensor(ids)
            prompt_mask[row, width - len(ids) :] = 1
        input_ids = torch.cat([prompt_ids, batch.response_ids], dim=1)  # (B, P + R)
        attention = torch.cat([prompt_mask, batch.response_mask.long()], dim=1)
        positions = (attention.cumsum(1) - 1).clamp(min=0)
        model.train()
        logits = model(input_ids=input_ids, attention_mask=attention, position_ids=positions).logits
        logprobs = torch.log_softmax(logits[:, width - 1 : -1].float(), dim=-1)  # (B, R, V)
        taken = logprobs.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)  # (B, R)
        mask = batch.response_mask.float()
        loss = -(advantages.view(-1, 1) * taken * mask).sum() / mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        model.eval()

    start, end = sum(mean_rewards[:5]) / 5, sum(mean_rewards[-10:]) / 10
    assert start < 0.12, mean_rewards
    assert end > 0.2 and end > 2.5 * start, mean_rewards
