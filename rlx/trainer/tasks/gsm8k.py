"""GSM8K's prompt rows from the dataset's own rows (`rlx data gsm8k SOURCE OUT`, through
rlx.trainer.tasks.benchmarks).

The source is GSM8K as published (openai/gsm8k, config `main`: a parquet or jsonl file with a
`question` and an `answer` whose last line is `#### N`). Each row becomes a chat prompt (a
system message, the question as the user's message) and `answer`, the number N, which the
gsm8k reward and the calculator environment compare with the number after the model's `####`.
With `tools` the system message teaches the calculator's call, `<calc>EXPR</calc>`
(recipes/gsm8k-tools.yaml); without it, the plain task (recipes/gsm8k-grpo.yaml's reward).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from rlx.trainer.tasks.data import DataError, chat_prompt_row

SYSTEM = (
    "Solve the math word problem. Reason briefly, then write the final answer on its own "
    "line as '#### N', where N is a number."
)
SYSTEM_TOOLS = (
    "Solve the math word problem. You have a calculator: write <calc>EXPRESSION</calc> "
    "(numbers, + - * / // % ** and parentheses) and stop; its result comes back in the next "
    "message, and you go on. Use it for arithmetic you are not sure of. When you know the "
    "answer, write it on its own line as '#### N', where N is a number, with no call in "
    "that message."
)
_FINAL = re.compile(r"####\s*(.+?)\s*$")


def prompt_rows(rows: Iterable[Mapping[str, Any]], source: str, tools: bool) -> list[dict]:
    """The prompt rows of GSM8K rows: prompt (chat messages), answer (the number)."""
    system = SYSTEM_TOOLS if tools else SYSTEM
    out = []
    for index, row in enumerate(rows):
        question, solution = row.get("question"), row.get("answer")
        if not isinstance(question, str) or not isinstance(solution, str):
            raise DataError(
                f"{source}: row {index}: GSM8K rows have text columns 'question' and "
                f"'answer'; this one has {sorted(row)} (is this openai/gsm8k's 'main' file?)"
            )
        final = _FINAL.search(solution.strip().splitlines()[-1] if solution.strip() else "")
        if final is None:
            raise DataError(
                f"{source}: row {index}: the answer does not end with a '#### N' line "
                f"({solution[-60:]!r})"
            )
        out.append(chat_prompt_row(system, question, final.group(1).replace(",", "")))
    return out
