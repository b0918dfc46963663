"""Reward functions: a name -> function table plus user functions loaded by spec.

Every reward function has the signature

    fn(prompt: str, response: str, answer: str | None) -> float

`prompt` is the text the policy saw (after any chat template), `response` the decoded
completion (special tokens removed), `answer` the row's reference answer or None when the
dataset has none. It returns a finite number, usually in [0, 1]; it must not mutate state
it shares with other calls, because batches may be scored in any order.

A spec names a built-in (`gsm8k`, `gsm8k_flexible`, `math_verify`, `math_exact`,
`letters_or_digits`, `digit_share`) or a user function: `package.module:function` (importable) or
`path/to/file.py:function`.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

from rlx.errors import RlxError
from rlx.trainer.tasks.preferences import digit_share
from rlx.trainer.tasks.synthetic import letters_or_digits_reward
from rlx.trainer.tasks.userspec import import_target, missing_name, spec_problem

RewardFn = Callable[[str, str, str | None], float]


class RewardSpecError(RlxError, ValueError):
    """A reward spec that names nothing usable."""


class RewardError(RlxError, RuntimeError):
    """A reward function that raised or returned something other than a finite number."""


# A number as people write it in answers: sign, $ sign, thousands commas, decimals.
_NUMBER = r"[-+]?\$?\s?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\$?\s?\.\d+"
_ANY_NUMBER = re.compile(_NUMBER)
_LEADING_NUMBER = re.compile(r"\s*(" + _NUMBER + ")")
_MARKER = "####"
MATH_VERIFY_TIMEOUT_S = 5  # per parse and per comparison: untrusted LaTeX can be slow


_PLAIN_NUMBER = re.compile(r"([-+]?)(\d*)(?:\.(\d*))?")


def normalize_number(text: str) -> str | None:
    """Canonical form of a written number, or None if `text` is not one.

    "1,234" -> "1234", "$5" -> "5", "+3" -> "3", "7.0" -> "7", "2.50" -> "2.5", "-0" -> "0".
    Pure string work, exact at any length (responses are untrusted and may be huge).
    """
    cleaned = text.strip().replace(",", "").replace("$", "").replace(" ", "")
    cleaned = cleaned.rstrip(".")  # a sentence-final period: "#### 12."
    match = _PLAIN_NUMBER.fullmatch(cleaned)
    if match is None:
        return None
    sign, whole, fraction = match.group(1), match.group(2), match.group(3) or ""
    if not whole and not fraction:
        return None
    whole = whole.lstrip("0") or "0"
    fraction = fraction.rstrip("0")
    if whole == "0" and not fraction:
        return "0"  # -0 is 0
    body = f"{whole}.{fraction}" if fraction else whole
    return f"-{body}" if sign == "-" else body


def _after_last_marker(text: str) -> str | None:
    """The number right after the last `####` in `text`, or None."""
    position = text.rfind(_MARKER)
    if position < 0:
        return None
    match = _LEADING_NUMBER.match(text, position + len(_MARKER))
    return match.group(1) if match else None


def _reference_number(answer: str | None, reward: str) -> str:
    """The number a reference answer stands for; a full GSM8K solution uses its `####`."""
    if answer is None:
        raise ValueError(f"{reward} needs a reference answer; the dataset gave none")
    marked = _after_last_marker(answer)
    number = normalize_number(marked if marked is not None else answer)
    if number is None:
        raise ValueError(f"{reward}: reference answer {answer!r} is not a number")
    return number


def gsm8k_strict(prompt: str, response: str, answer: str | None) -> float:
    """1.0 if the number right after the last `####` in the response equals the answer.

    A response without `####`, or with no number after its last one, scores 0.
    """
    expected = _reference_number(answer, "gsm8k")
    return float(gsm8k_answer(response) == expected)


def gsm8k_flexible(prompt: str, response: str, answer: str | None) -> float:
    """1.0 if the last number anywhere in the response equals the answer, else 0."""
    expected = _reference_number(answer, "gsm8k_flexible")
    return float(last_number_answer(response) == expected)


def gsm8k_answer(response: str) -> str | None:
    """The answer gsm8k reads from a response: the number after its last `####`, normalised
    (None without one)."""
    found = _after_last_marker(response)
    return None if found is None else normalize_number(found)


def last_number_answer(response: str) -> str | None:
    """The answer gsm8k_flexible reads: the response's last number, normalised."""
    found = _ANY_NUMBER.findall(response)
    return normalize_number(found[-1]) if found else None


def _normalize_text(text: str) -> str:
    collapsed = " ".join(text.split())
    number = normalize_number(collapsed)
    return number if number is not None else collapsed


def math_exact(prompt: str, response: str, answer: str | None) -> float:
    """1.0 if the WHOLE response equals the answer after collapsing whitespace (and, when
    both are numbers, after normalising them: "1,000.0" equals "1000"), else 0. Nothing is
    extracted: "The answer is \\boxed{5}." scores 0 against "5"; use math_verify for that."""
    if answer is None:
        raise ValueError("math_exact needs a reference answer; the dataset gave none")
    return float(_normalize_text(response) == _normalize_text(answer))


_MATH_VERIFY_WARM = threading.Event()


def _warm_math_verify(parse: Any, verify: Any) -> None:
    """One parse and comparison without a time limit, once per process: math-verify builds
    its LaTeX grammar and imports sympy's parts on first use, seconds on a busy machine,
    which the per-answer limit must not count (it would score a right answer 0)."""
    if not _MATH_VERIFY_WARM.is_set():
        half = parse("$\\frac{1}{2}$", parsing_timeout=None)
        verify(half, parse("\\boxed{0.5}", parsing_timeout=None), timeout_seconds=None)
        _MATH_VERIFY_WARM.set()


def _math_verify() -> tuple[Any, Any]:
    try:
        from math_verify import parse, verify
    except ImportError as exc:
        raise RewardSpecError(
            'reward math_verify needs the math-verify package; pip install "rlx[train]"'
        ) from exc
    return parse, verify


def _math_verify_limit() -> int | None:
    """math-verify's timeouts are signal alarms, which work only in the main thread."""
    return MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def math_verify_answer(response: str) -> str | None:
    """The final answer math_verify reads from a response, in sympy's canonical form (so
    "\\frac{1}{2}" and "0.5" read alike), or None where it finds none."""
    parse, verify = _math_verify()
    _warm_math_verify(parse, verify)
    found = parse(response, parsing_timeout=_math_verify_limit())
    if not found:
        return None
    value = found[0]
    if getattr(value, "is_number", False):  # 0.5 and 1/2 alike: the exact rational
        import sympy

        value = sympy.nsimplify(value, rational=True)
    return str(value)


def math_verify(prompt: str, response: str, answer: str | None) -> float:
    """1.0 if the response's final answer is mathematically equal to the reference, else 0,
    judged by Hugging Face's math-verify: it extracts the answer (\\boxed{} first, then
    LaTeX or plain expressions) and compares symbolically, so "\\frac{1}{2}" equals "0.5".
    A response with no extractable answer scores 0."""
    if answer is None:
        raise ValueError("math_verify needs a reference answer; the dataset gave none")
    parse, verify = _math_verify()
    _warm_math_verify(parse, verify)
    limit = _math_verify_limit()
    gold = parse(answer, parsing_timeout=limit) or parse(f"${answer}$", parsing_timeout=limit)
    if not gold:
        raise ValueError(f"math_verify: reference answer {answer!r} has no parsable answer")
    found = parse(response, parsing_timeout=limit)
    return float(bool(found) and verify(gold, found, timeout_seconds=limit))


REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "gsm8k": gsm8k_strict,
    "gsm8k_flexible": gsm8k_flexible,
    "math_verify": math_verify,
    "math_exact": math_exact,
    "letters_or_digits": letters_or_digits_reward,
    "digit_share": digit_share,
}


# The answer each built-in reward compares, read from a response as the reward reads it and
# normalised as it normalises it: samples whose answers are equal here agree (maj@k votes
# with them). Rewards not named here compare no answers.
ANSWER_EXTRACTORS: dict[str, Callable[[str], str | None]] = {
    "gsm8k": gsm8k_answer,
    "gsm8k_flexible": last_number_answer,
    "math_verify": math_verify_answer,
    "math_exact": _normalize_text,
}


def answer_extractor(settings: Any) -> Callable[[str], str | None] | None:
    """How a run's samples are told to agree (maj@n, in `rlx eval` and validation): the
    extractor of its one reward function (trainer.reward, gsm8k in its gsm8k_mode), or None
    where it compares no answers (another reward, a mix of terms, an environment's)."""
    if settings.rewards is not None or settings.environment is not None:
        return None
    spec = settings.reward.function
    if spec == "gsm8k" and settings.reward.gsm8k_mode == "flexible":
        spec = "gsm8k_flexible"
    return ANSWER_EXTRACTORS.get(spec)


def reward_spec_problem(spec: str) -> str | None:
    """What is wrong with a reward spec's form, before anything is imported (None when it
    names a built-in or looks like a user function). Lint asks this too."""
    return spec_problem(spec, "reward", REWARD_FUNCTIONS, "a user function", "function")


def resolve_reward(spec: str) -> RewardFn:
    """The reward function `spec` names; user modules are imported only now.

    Raises RewardSpecError (a ValueError) naming the spec and what would be valid.
    """
    problem = reward_spec_problem(spec)
    if problem is not None:
        raise RewardSpecError(problem)
    if spec in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[spec]
    module, func_name = import_target(spec, "reward", RewardSpecError)
    fn = getattr(module, func_name, None)
    if fn is None:
        raise RewardSpecError(missing_name(module, spec, "reward", "functions", callable))
    if not callable(fn):
        raise RewardSpecError(f"reward {spec!r}: {func_name!r} is not callable")
    return fn


def reward_name(fn: RewardFn) -> str:
    module = getattr(fn, "__module__", None) or "?"
    return f"{module}:{getattr(fn, '__qualname__', repr(fn))}"


def _as_float(value: object) -> float | None:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def score(
    fn: RewardFn,
    prompts: Sequence[str],
    responses: Sequence[str],
    answers: Sequence[str | None] | None = None,
) -> list[float]:
    """Apply `fn` to each sample; answers=None means no sample has a reference answer.

    A reward that raises, or returns anything but a finite real number, becomes a
    RewardError naming the function and the sample index.
    """
    if answers is None:
        answers = [None] * len(prompts)
    if not len(prompts) == len(responses) == len(answers):
        raise ValueError(
            f"score: {len(prompts)} prompts, {len(responses)} responses and "
            f"{len(answers)} answers; they must be equally many"
        )
    scores: list[float] = []
    for index, (prompt, response, answer) in enumerate(
        zip(prompts, responses, answers, strict=True)
    ):
        try:
            value = fn(prompt, response, answer)
        except Exception as exc:
            raise RewardError(
                f"reward {reward_name(fn)} failed on sample {index}: {type(exc).__name__}: {exc}"
            ) from exc
        # numpy and torch scalars convert; text or None means a bug in the reward.
        number = None if isinstance(value, (str, bytes)) or value is None else _as_float(value)
        if number is None or not math.isfinite(number):
            raise RewardError(
                f"reward {reward_name(fn)} returned {value!r} for sample {index}; "
                "it must return a finite float"
            )
        scores.append(number)
    return scores
