"""Built-in tool environments (trainer.environment.function) and the synthetic tool task.

`tool_lookup` (synthetic:tool_lookup, runs on CPU in minutes): the prompt asks for the
code of a box; the code is a digit the prompt does not contain, so only the tool knows it.
The model calls the tool with a turn that holds a `?`, the tool answers with the code (the
digit written CODE_REPEATS times) as a `tool` chat message, and the model's next turn is
its answer. The call earns CALL_REWARD,
less a share for each character besides the `?` (at most half); an answer that
starts with the code earns ANSWER_REWARD, less the same way, and one that starts with another
digit DIGIT_REWARD. Box names are letters: the tool's message holds the only digit of the
episode.
A random policy scores about 0. The protocol alone (a clean call, then a digit) is worth
CALL_REWARD + (ANSWER_REWARD + 9 * DIGIT_REWARD) / 10 = 0.45 to a policy that guesses the
digit; above that the answers must come from the tool's message. The environment reports
`env/answered_code` (the share of answers that are the code; 0.1 for a guess) and
`env/used_tool` (the share of episodes that called the tool first).

`calculator` (gsm8k with a Python calculator): a turn that holds `<calc>EXPR</calc>` asks
for the value of an arithmetic expression (numbers, + - * / // % **, parentheses; evaluated
from its syntax tree, never by eval); the tool answers with the value. A turn without a
call is the final answer, scored like the gsm8k reward (the number after `####`).
"""

from __future__ import annotations

import ast
import json
import math
import operator
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlx.trainer.episodes.env import Row, Step, Turn

CALL = "?"
CALL_REWARD = 0.3
ANSWER_REWARD = 0.6
DIGIT_REWARD = 0.1  # an answer that is a digit, the wrong one
CODE_REPEATS = 8  # the tool writes the code this many times: a tiny model reads it sooner
EXTRA_COST = 0.1  # a call or an answer that starts right loses this share per extra char...
MOST_LOST = 0.5  # ...up to this share


def _share(extra: int) -> float:
    return 1.0 - min(MOST_LOST, EXTRA_COST * extra)


class LookupTool:
    """The synthetic tool task's environment (see the module's text)."""

    def reset(self, row: Row) -> None:
        if row.answer is None or not row.answer.isdigit():
            raise ValueError(f"row {row.index}: tool_lookup needs a digit as its answer")
        self.code = row.answer
        self.called = False

    def step(self, turn: Turn) -> Step:
        text = turn.text.strip()
        if CALL in text and not self.called:
            # The call pays, less for each other character; the turn after it is the answer.
            self.called = True
            return Step(
                observation={"role": "tool", "content": self.code * CODE_REPEATS},
                reward=_share(len(text) - 1) * CALL_REWARD,
                tool_calls=1,
            )
        # What the task is about: answers that are the tool's code (a guess is right 1 in 10).
        right = {"answered_code": float(text[:1] == self.code), "used_tool": float(self.called)}
        if text[:1] == self.code:
            return Step(reward=_share(len(text) - 1) * ANSWER_REWARD, done=True, metrics=right)
        reward = DIGIT_REWARD if text[:1].isdigit() else 0.0
        return Step(reward=reward, done=True, metrics=right)


def write_tool_lookup_dataset(path: str | Path, n: int, seed: int, held_out: bool = False) -> Path:
    """`n` rows {"prompt", "answer"}: a box name and its code (a digit). Held out: box
    names of letters the training rows never use."""
    rng = random.Random(seed + (1_000_003 if held_out else 0))
    rows = []
    for _ in range(n):
        letters = "abcdefghijklm" if held_out else "nopqrstuvwxyz"
        box = "".join(rng.choice(letters) for _ in range(3))
        rows.append({"prompt": f"Code of box {box}?", "answer": str(rng.randint(0, 9))})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


# ------------------------------------------------------------------------- calculator

_CALL_PATTERN = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
_OPERATORS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 1e15


def evaluate(expression: str) -> float:
    """The value of an arithmetic expression, from its syntax tree; ValueError for anything
    else (names, calls, huge powers, division by zero)."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an expression: {exc.msg}") from None

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 1e6):
                raise ValueError("power too large")
            try:
                result = _OPERATORS[type(node.op)](left, right)
            except ZeroDivisionError:
                raise ValueError("division by zero") from None
            if isinstance(result, complex) or abs(result) > MAX_MAGNITUDE:
                raise ValueError("result out of range")
            return result
        raise ValueError(f"{type(node).__name__} is not allowed; only numbers and + - * / ** %")

    return value(tree.body)


def format_number(number: float) -> str:
    if isinstance(number, int) or (math.isfinite(number) and float(number).is_integer()):
        return str(int(number))
    return f"{number:.6g}"


class Calculator:
    """gsm8k with a Python calculator (see the module's text)."""

    def reset(self, row: Row) -> None:
        self.answer = row.answer

    def step(self, turn: Turn) -> Step:
        from rlx.trainer.tasks.rewards import gsm8k_strict

        calls = _CALL_PATTERN.findall(turn.text)
        if not calls:
            if "<calc>" in turn.text:
                return Step(
                    observation={"role": "tool", "content": "error: close the call with </calc>"},
                    tool_calls=1,
                    tool_error="malformed call: <calc> without </calc>",
                )
            return Step(reward=gsm8k_strict("", turn.text, self.answer), done=True)
        results, error = [], None
        for expression in calls:
            try:
                results.append(format_number(evaluate(expression)))
            except ValueError as exc:
                error = f"calculator: {exc}"
                results.append(f"error: {exc}")
        return Step(
            observation={"role": "tool", "content": "\n".join(results)},
            tool_calls=len(calls),
            tool_error=error,
        )
