"""A reward model made on this machine, for the runs that learn from one (quickstart-rm).

The preference: of two responses to a prompt of the synthetic task, the one with the larger
share of digits is preferred (digit_share, a built-in reward, measures the same property and
runs beside the reward model as a weight-0 monitor: it shows whether what the reward model
rewards is what the policy learns). The model: a tiny one-label classifier of the policy's
architecture and byte-level tokenizer (rlx.trainer.model.tiny.build_tiny_reward_model), so it
reads the policy's token ids as they are, trained on the pairs with the Bradley-Terry loss
(-log sigmoid(r_chosen - r_rejected)) and saved with save_pretrained.

    python -m rlx.trainer.tasks.preferences ./runs/digits-rm
"""

from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rlx.trainer.tasks.synthetic import CHARSETS, MIN_CHARS, letters_or_digits_prompt

DIGITS = "0123456789"
OTHERS = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ.,"


def digit_share(prompt: str, response: str, answer: str | None) -> float:
    """Share of the response's characters that are digits (over at least MIN_CHARS): the
    property the preference pairs prefer, whatever the prompt asks."""
    del prompt, answer
    return sum(char in DIGITS for char in response) / max(len(response), MIN_CHARS)


@dataclass(frozen=True)
class Pair:
    prompt: str
    chosen: str
    rejected: str


def _response(rng: random.Random, digits: float) -> str:
    length = rng.randint(4, 32)
    return "".join(
        rng.choice(DIGITS) if rng.random() < digits else rng.choice(OTHERS) for _ in range(length)
    )


def preference_pairs(count: int, seed: int) -> list[Pair]:
    """`count` pairs: a prompt of the synthetic task and two responses whose digit shares
    differ by at least 0.2, the larger one chosen."""
    rng = random.Random(seed)
    pairs = []
    while len(pairs) < count:
        prompt = letters_or_digits_prompt(rng.choice(sorted(CHARSETS)))
        a, b = _response(rng, rng.random()), _response(rng, rng.random())
        share_a, share_b = digit_share(prompt, a, None), digit_share(prompt, b, None)
        if abs(share_a - share_b) < 0.2:
            continue
        pairs.append(Pair(prompt, a, b) if share_a > share_b else Pair(prompt, b, a))
    return pairs


def train_reward_model(
    out_dir: str | Path,
    *,
    pairs: int = 2048,
    epochs: int = 2,
    batch_size: int = 32,
    lr: float = 2e-3,
    seed: int = 0,
) -> tuple[Path, float]:
    """Build the tiny reward model in out_dir, train it on preference pairs and save it:
    its folder and its accuracy on held-out pairs (how often it scores the chosen higher)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlx.trainer.model.tiny import build_tiny_reward_model

    folder = build_tiny_reward_model(out_dir, hidden_size=64, num_layers=2, seed=seed)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32)
    pad = tokenizer.pad_token_id

    def ids(prompt: str, response: str) -> list[int]:
        # As the policy's run reads a plain-text prompt and its response.
        return list(tokenizer(prompt)["input_ids"]) + list(
            tokenizer(response, add_special_tokens=False)["input_ids"]
        )

    def scores(texts: list[tuple[str, str]]) -> torch.Tensor:
        rows = [ids(p, r) for p, r in texts]
        width = max(len(row) for row in rows)
        input_ids = torch.tensor([row + [pad] * (width - len(row)) for row in rows])
        mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
        return model(input_ids=input_ids, attention_mask=mask).logits[:, 0]

    train, held_out = preference_pairs(pairs, seed), preference_pairs(256, seed + 1)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    order = random.Random(seed)
    model.train()
    for _ in range(epochs):
        order.shuffle(train)
        for start in range(0, len(train), batch_size):
            batch = train[start : start + batch_size]
            chosen = scores([(p.prompt, p.chosen) for p in batch])
            rejected = scores([(p.prompt, p.rejected) for p in batch])
            loss = -torch.nn.functional.logsigmoid(chosen - rejected).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.eval()
    with torch.inference_mode():
        chosen = scores([(p.prompt, p.chosen) for p in held_out])
        rejected = scores([(p.prompt, p.rejected) for p in held_out])
    accuracy = float((chosen > rejected).float().mean())
    model.save_pretrained(folder)
    return folder, accuracy


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m rlx.trainer.tasks.preferences OUT_DIR", file=sys.stderr)
        return 1
    started = time.monotonic()
    folder, accuracy = train_reward_model(argv[0])
    print(
        f"reward model in {folder}: prefers the response with more digits on "
        f"{accuracy:.0%} of held-out pairs ({time.monotonic() - started:.0f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
