"""Small tasks generated locally, for the quickstart and the learning tests.

`letters_or_digits`: the prompt asks for digits or for letters and the reward is the share
of the response made of the requested kind. A random byte-level policy scores about 0.07.
Plain GRPO on the default tiny model (4 prompts x 16 samples x 32 tokens per step, Adam at
2e-3) lifts it to about 0.4 by step 60 and 0.75-1.0 by step 150, a few tenths of a second
per step on two CPU cores; to pass 0.5 the model must read the prompt, since one kind
scores 0 on the other's prompts.

`arithmetic`: GSM8K-style sums and differences whose answer follows `#### `; it exercises
the gsm8k reward and the verl parquet layout, and is not meant to be learnable by a tiny model.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path

# Requested kind -> the characters that count toward the reward.
CHARSETS: dict[str, str] = {
    "digits": "0123456789",
    "letters": "abcdefghijklmnopqrstuvwxyz",
}
# A response shorter than this many characters is scored as if padded with wrong ones,
# so stopping after one good character does not pay.
MIN_CHARS = 16


def letters_or_digits_prompt(kind: str) -> str:
    return f"Write {kind}."


def _kind_from_prompt(prompt: str) -> str:
    for kind in CHARSETS:
        if letters_or_digits_prompt(kind) in prompt:
            return kind
    raise ValueError(f"prompt {prompt!r} names none of: {', '.join(CHARSETS)}")


def letters_or_digits_reward(prompt: str, response: str, answer: str | None) -> float:
    """Share of `response` characters of the kind `answer` names ("digits" or "letters").

    Without an answer the kind is read from the prompt. The denominator is at least
    MIN_CHARS, so the score is in [0, 1] and reaches 1 only for a long enough response.
    """
    kind = answer if answer is not None else _kind_from_prompt(prompt)
    if kind not in CHARSETS:
        raise ValueError(f"answer {kind!r} is not one of: {', '.join(CHARSETS)}")
    allowed = set(CHARSETS[kind])
    good = sum(char in allowed for char in response)
    return good / max(len(response), MIN_CHARS)


def _write_jsonl(path: Path, rows: Iterable[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


# Phrasings the training rows never use: a held-out set of the task (validation).
HELD_OUT_PHRASINGS: tuple[str, ...] = ("Now write {kind}.", "Write {kind}, please.", "{kind}?")


def write_synthetic_dataset(path: str | Path, n: int, seed: int, held_out: bool = False) -> Path:
    """Write `n` rows {"prompt", "answer"} of the letters-or-digits task as jsonl; held_out:
    in phrasings the training rows never use (the answer names the kind)."""
    rng = random.Random(seed)
    kinds = sorted(CHARSETS)
    rows = []
    for _ in range(n):
        kind = rng.choice(kinds)
        if held_out:
            prompt = rng.choice(HELD_OUT_PHRASINGS).format(kind=kind)
        else:
            prompt = letters_or_digits_prompt(kind)
        rows.append({"prompt": prompt, "answer": kind})
    return _write_jsonl(Path(path), rows)


def arithmetic_rows(n: int, seed: int) -> list[dict[str, str]]:
    """`n` GSM8K-style questions: "prompt" asks for a sum or difference (answers may be
    negative and run into the thousands), "answer" is its value."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 2000), rng.randint(0, 999)
        op = rng.choice("+-")
        value = a + b if op == "+" else a - b
        question = f"What is {a} {op} {b}? Give the final answer after '#### '."
        rows.append({"prompt": question, "answer": str(value)})
    return rows


def write_arithmetic_dataset(path: str | Path, n: int, seed: int, held_out: bool = False) -> Path:
    """Write the arithmetic task: `.jsonl` as {"prompt", "answer"} rows, `.parquet` in
    verl's GSM8K layout (data_source, prompt as chat messages, reward_model.ground_truth).
    """
    path = Path(path)
    # Held out: other numbers (a stream of its own); any repeat of a training question is
    # dropped when the validation set is loaded.
    rows = arithmetic_rows(n, seed + 1_000_003 if held_out else seed)
    if path.suffix == ".jsonl":
        return _write_jsonl(path, rows)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        verl_rows = [
            {
                "data_source": "synthetic/arithmetic",
                "prompt": [{"role": "user", "content": row["prompt"]}],
                "ability": "math",
                "reward_model": {"ground_truth": row["answer"], "style": "rule"},
                "extra_info": {"index": index, "split": "train"},
            }
            for index, row in enumerate(rows)
        ]
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(verl_rows), path)
        return path
    raise ValueError(f"cannot write {path}: use a .jsonl or .parquet file name")
