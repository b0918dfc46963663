from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from rlx.trainer.tasks.rewards import (
    REWARD_FUNCTIONS,
    RewardError,
    RewardSpecError,
    gsm8k_flexible,
    gsm8k_strict,
    math_exact,
    normalize_number,
    resolve_reward,
    score,
)
from rlx.trainer.tasks.synthetic import arithmetic_rows


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("72", "72"),
        ("1,234", "1234"),
        ("1,234,567.00", "1234567"),
        ("$5", "5"),
        ("$ 1,000", "1000"),
        ("+3", "3"),
        ("-12", "-12"),
        ("-0", "0"),
        ("7.0", "7"),
        ("2.50", "2.5"),
        ("0.125", "0.125"),
        (".5", "0.5"),
        ("12.", "12"),
        ("twelve", None),
        ("", None),
        ("nan", None),
        ("1e3", None),
        ("007", "7"),
        ("-.50", "-0.5"),
        ("12345678901234567890123456789.5", "12345678901234567890123456789.5"),
        ("9" * 10_000, "9" * 10_000),  # no int() conversion limit, no rounding
        ("1.2.3", None),
        ("-", None),
    ],
)
def test_normalize_number(text: str, expected: str | None) -> None:
    assert normalize_number(text) == expected


@pytest.mark.parametrize(
    ("response", "answer", "strict", "flexible"),
    [
        ("She has 3 + 4 = 7 apples.\n#### 7", "7", 1.0, 1.0),
        ("#### 8", "7", 0.0, 0.0),
        ("The total is 1,234 dollars.\n#### 1,234", "1234", 1.0, 1.0),
        ("#### $1,234.00", "1234", 1.0, 1.0),
        ("#### -5", "-5", 1.0, 1.0),
        ("#### 5", "-5", 0.0, 0.0),
        ("#### 2.50", "2.5", 1.0, 1.0),
        ("#### 2.5", "2.51", 0.0, 0.0),
        ("#### +3", "3", 1.0, 1.0),
        ("####12", "12", 1.0, 1.0),
        ("#### 12.", "12", 1.0, 1.0),
        # no marker: strict fails, flexible reads the last number
        ("so the answer is 42", "42", 0.0, 1.0),
        ("42 is wrong, it is 41", "42", 0.0, 0.0),
        # the last marker counts, not the first
        ("#### 7 no wait\n#### 8", "8", 1.0, 1.0),
        ("#### 8 and then #### 7", "8", 0.0, 0.0),
        # a marker with no number after it
        ("#### 8\n#### unsure", "8", 0.0, 1.0),
        ("", "3", 0.0, 0.0),
        # a full GSM8K solution as the reference answer: its #### number counts
        ("#### 72", "Natalia sold 48/2 = 24 clips.\n#### 72", 1.0, 1.0),
        ("#### 72", "72.0", 1.0, 1.0),
    ],
)
def test_gsm8k_strict_and_flexible(
    response: str, answer: str, strict: float, flexible: float
) -> None:
    assert gsm8k_strict("q", response, answer) == strict
    assert gsm8k_flexible("q", response, answer) == flexible


def test_gsm8k_needs_a_numeric_answer() -> None:
    with pytest.raises(ValueError, match="needs a reference answer"):
        gsm8k_strict("q", "#### 1", None)
    with pytest.raises(ValueError, match="'seven' is not a number"):
        gsm8k_flexible("q", "#### 7", "seven")


def test_gsm8k_on_the_synthetic_arithmetic_rows() -> None:
    rows = arithmetic_rows(20, seed=1)
    for row in rows:
        correct = f"Adding gives {row['answer']}.\n#### {row['answer']}"
        wrong = f"#### {int(row['answer']) + 1}"
        assert gsm8k_strict(row["prompt"], correct, row["answer"]) == 1.0
        assert gsm8k_strict(row["prompt"], wrong, row["answer"]) == 0.0
    answers = [int(row["answer"]) for row in arithmetic_rows(200, seed=1)]
    assert min(answers) < 0 < max(answers)
    assert max(answers) >= 1000  # written with a thousands comma by people


@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [
        ("x + 1", "x + 1", 1.0),
        ("  x   +\n1 ", "x + 1", 1.0),
        ("x+1", "x + 1", 0.0),
        ("1,000.0", "1000", 1.0),
        ("-0.50", "-.5", 1.0),
        ("1000", "1001", 0.0),
        ("Paris", "paris", 0.0),
    ],
)
def test_math_exact(response: str, answer: str, expected: float) -> None:
    assert math_exact("q", response, answer) == expected


def test_math_exact_extracts_nothing() -> None:
    # It does what its name says: the whole response must be the answer.
    assert math_exact("q", "The answer is \\boxed{5}.", "5") == 0.0


@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [
        ("The answer is \\boxed{5}.", "5", 1.0),
        ("\\frac{1}{2}", "0.5", 1.0),
        ("So $x = \\boxed{\\frac{\\sqrt{3}}{2}}$.", "\\frac{\\sqrt3}{2}", 1.0),
        ("First 3, then the answer is \\boxed{12}", "12", 1.0),
        ("The answer is \\boxed{6}.", "5", 0.0),
        ("\\boxed{\\frac{1}{3}}", "0.5", 0.0),
        ("I do not know.", "5", 0.0),
    ],
)
def test_math_verify(response: str, answer: str, expected: float) -> None:
    pytest.importorskip("math_verify")
    assert resolve_reward("math_verify")("q", response, answer) == expected


def test_math_verify_needs_an_answer() -> None:
    with pytest.raises(ValueError, match="reference answer"):
        resolve_reward("math_verify")("q", "\\boxed{5}", None)


def test_builtin_names_resolve() -> None:
    assert resolve_reward("gsm8k") is gsm8k_strict
    assert resolve_reward("gsm8k_flexible") is gsm8k_flexible
    assert set(REWARD_FUNCTIONS) >= {"gsm8k", "gsm8k_flexible", "math_exact", "letters_or_digits"}


def test_unknown_name_lists_the_valid_ones() -> None:
    with pytest.raises(RewardSpecError) as info:
        resolve_reward("gsm9k")
    message = str(info.value)
    assert "'gsm9k'" in message
    assert "gsm8k, gsm8k_flexible, letters_or_digits, math_exact, math_verify" in message
    assert "module:function" in message
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("spec", [":f", "mod:", "mod:not-an-identifier"])
def test_malformed_specs(spec: str) -> None:
    with pytest.raises(RewardSpecError, match="bad reward spec"):
        resolve_reward(spec)


@pytest.fixture
def reward_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    package = tmp_path / "my_rewards_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "scoring.py").write_text(
        textwrap.dedent(
            """
            def length_bonus(prompt, response, answer):
                return min(len(response), 10) / 10

            def broken(prompt, response, answer):
                if "boom" in response:
                    raise ZeroDivisionError("boom in response")
                return 1.0

            def returns_text(prompt, response, answer):
                return "1.0"

            NOT_CALLABLE = 3
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards_pkg.scoring"
    for name in [m for m in sys.modules if m.startswith("my_rewards_pkg")]:
        del sys.modules[name]


def test_custom_reward_from_module(reward_package: str) -> None:
    fn = resolve_reward(f"{reward_package}:length_bonus")
    assert fn("p", "abcde", None) == 0.5
    assert score(fn, ["p", "p"], ["ab", "a" * 40]) == [0.2, 1.0]


def test_custom_reward_module_errors(reward_package: str) -> None:
    with pytest.raises(RewardSpecError, match=r"has no attribute 'missing'.*length_bonus"):
        resolve_reward(f"{reward_package}:missing")
    with pytest.raises(RewardSpecError, match="'NOT_CALLABLE' is not callable"):
        resolve_reward(f"{reward_package}:NOT_CALLABLE")
    with pytest.raises(RewardSpecError, match="cannot import module 'no_such_module_xyz'"):
        resolve_reward("no_such_module_xyz:fn")


def test_custom_reward_from_file(tmp_path: Path) -> None:
    path = tmp_path / "rules" / "my_reward.py"
    path.parent.mkdir()
    path.write_text("def exact(prompt, response, answer):\n    return float(response == answer)\n")
    fn = resolve_reward(f"{path}:exact")
    assert score(fn, ["p", "p"], ["yes", "no"], ["yes", "yes"]) == [1.0, 0.0]
    with pytest.raises(RewardSpecError, match="does not exist"):
        resolve_reward(f"{tmp_path / 'nope.py'}:exact")
    with pytest.raises(RewardSpecError, match=r"has no attribute 'other'.*exact"):
        resolve_reward(f"{path}:other")
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_module_xyz\n")
    with pytest.raises(RewardSpecError, match=r"importing .*broken.py' failed: ModuleNotFound"):
        resolve_reward(f"{broken}:exact")


def test_two_reward_files_with_the_same_name_stay_apart(tmp_path: Path) -> None:
    for folder, value in (("a", 1.0), ("b", 2.0)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "reward.py").write_text(f"def fn(p, r, a):\n    return {value}\n")
    first = resolve_reward(f"{tmp_path / 'a' / 'reward.py'}:fn")
    second = resolve_reward(f"{tmp_path / 'b' / 'reward.py'}:fn")
    assert (first("", "", None), second("", "", None)) == (1.0, 2.0)


def test_score_names_the_function_and_the_sample_that_failed(reward_package: str) -> None:
    fn = resolve_reward(f"{reward_package}:broken")
    with pytest.raises(RewardError) as info:
        score(fn, ["p"] * 3, ["fine", "fine", "boom"], [None] * 3)
    message = str(info.value)
    assert "my_rewards_pkg.scoring:broken" in message
    assert "sample 2" in message
    assert "ZeroDivisionError: boom in response" in message
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_score_rejects_non_numbers(reward_package: str) -> None:
    fn = resolve_reward(f"{reward_package}:returns_text")
    with pytest.raises(RewardError, match=r"returned '1\.0' for sample 0"):
        score(fn, ["p"], ["r"])
    with pytest.raises(RewardError, match="returned nan for sample 1"):
        score(lambda p, r, a: float("nan") if r == "x" else 0.0, ["p", "p"], ["y", "x"])


def test_score_accepts_numpy_and_bool_values() -> None:
    np = pytest.importorskip("numpy")
    assert score(lambda p, r, a: np.float32(0.25), ["p"], ["r"]) == [0.25]
    assert score(lambda p, r, a: r == "ok", ["p", "p"], ["ok", "no"]) == [1.0, 0.0]


def test_score_checks_lengths() -> None:
    with pytest.raises(ValueError, match="2 prompts, 1 responses and 2 answers"):
        score(gsm8k_strict, ["a", "b"], ["#### 1"], ["1", "2"])


def test_score_gsm8k_batch() -> None:
    fn = resolve_reward("gsm8k")
    responses = ["#### 10", "#### 1,000", "no marker 5", "#### -3"]
    answers = ["10", "1000", "5", "3"]
    assert score(fn, ["q"] * 4, responses, answers) == [1.0, 1.0, 0.0, 0.0]
