"""The environment interface: what a step may return, calls that raise or hang (sync and
asyncio) and specs that name nothing usable, each one line."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from rlx.trainer.episodes.env import (
    EnvironmentSpecError,
    EpisodeFailure,
    Step,
    as_step,
    call_environment,
    resolve_environment,
)
from rlx.trainer.tasks.tools import Calculator, LookupTool, evaluate


def run(coroutine):
    return asyncio.new_event_loop().run_until_complete(coroutine)


def test_a_step_is_a_step_or_a_dict_of_its_fields() -> None:
    assert as_step({"reward": 1, "done": True}) == Step(reward=1.0, done=True)
    assert as_step(Step(observation=[3, 4])).observation == [3, 4]
    with pytest.raises(EpisodeFailure, match=r"unknown keys \['rewrd'\]"):
        as_step({"rewrd": 1})
    with pytest.raises(EpisodeFailure, match="reward nan; it must be a finite float"):
        as_step(Step(reward=float("nan")))
    with pytest.raises(EpisodeFailure, match="without 'role' and 'content'"):
        as_step(Step(observation={"text": "hi"}))
    with pytest.raises(EpisodeFailure, match="returned tuple, not a Step"):
        as_step(("obs", 1.0, True))


def test_calls_that_raise_or_hang_fail_in_one_line() -> None:
    def boom(_):
        raise ZeroDivisionError("division by zero")

    def hang(_):
        time.sleep(30)

    async def hang_async(_):
        await asyncio.sleep(30)

    async def fine(x):
        return x + 1

    with pytest.raises(EpisodeFailure) as caught:
        run(call_environment(boom, None, 5, "step()"))
    assert str(caught.value) == "step() raised ZeroDivisionError: division by zero"
    started = time.monotonic()
    for method in (hang, hang_async):
        with pytest.raises(EpisodeFailure) as caught:
            run(call_environment(method, None, 0.2, "step()"))
        assert str(caught.value) == "step() took longer than 0.2 s (step_timeout_s)"
    assert time.monotonic() - started < 10  # the hanging thread is left behind, not joined
    assert run(call_environment(fine, 1, 5, "step()")) == 2
    assert run(call_environment(lambda x: x * 2, 4, 5, "step()")) == 8


def test_specs_name_a_class_with_reset_and_step(tmp_path: Path, monkeypatch) -> None:
    assert resolve_environment("tool_lookup") is LookupTool
    assert resolve_environment("calculator") is Calculator
    monkeypatch.chdir(tmp_path)
    (tmp_path / "envs.py").write_text(
        "class Good:\n    def reset(self, row): pass\n    def step(self, turn): pass\n"
        "class NoStep:\n    def reset(self, row): pass\n"
    )
    assert resolve_environment("envs.py:Good").__name__ == "Good"
    cases = {
        "nothing": "unknown environment 'nothing'; valid: calculator, tool_lookup, or a class",
        "missing.py:Env": "environment 'missing.py:Env': file 'missing.py' does not exist",
        "envs.py:Bad": "environment 'envs.py:Bad': 'envs.py' has no attribute 'Bad'; its "
        "classes: Good, NoStep",
        "envs.py:NoStep": "'NoStep' must be a class with reset(row) and step(turn) methods; it "
        "lacks step",
    }
    for spec, message in cases.items():
        with pytest.raises(EnvironmentSpecError) as caught:
            resolve_environment(spec)
        assert message in str(caught.value) and "\n" not in str(caught.value)


def test_the_calculator_evaluates_arithmetic_and_names_malformed_calls() -> None:
    from rlx.trainer.episodes.env import Row, Turn

    assert evaluate("(3 + 4) * 2 ** 3 / 4") == 14
    for bad in ("__import__('os')", "2 ** 999", "1 / 0", "x + 1"):
        with pytest.raises(ValueError):
            evaluate(bad)
    env = Calculator()
    env.reset(Row(prompt="?", answer="72"))
    call = env.step(Turn(0, "so <calc>8 * 9</calc>", (1,), True))
    assert call.observation == {"role": "tool", "content": "72"} and call.tool_calls == 1
    assert call.tool_error is None and not call.done
    malformed = env.step(Turn(1, "<calc>8 *</calc>", (1,), True))
    assert malformed.tool_error is not None and malformed.tool_error.startswith("calculator: ")
    unclosed = env.step(Turn(2, "<calc>8 * 9", (1,), True))
    assert unclosed.tool_error == "malformed call: <calc> without </calc>"
    answer = env.step(Turn(3, "It is 72.\n#### 72", (1,), True))
    assert answer.done and answer.reward == 1.0


def test_the_lookup_tool_pays_for_a_call_and_for_the_code_it_gave() -> None:
    from rlx.trainer.episodes.env import Row, Turn
    from rlx.trainer.tasks.tools import ANSWER_REWARD, CALL_REWARD, CODE_REPEATS, DIGIT_REWARD

    def episode(*texts: str) -> list[Step]:
        env = LookupTool()
        env.reset(Row(prompt="Code of box abc?", answer="7"))
        return [as_step(env.step(Turn(i, text, (1,), True))) for i, text in enumerate(texts)]

    call, answer = episode("?", "7")
    assert call.reward == CALL_REWARD and call.tool_calls == 1 and not call.done
    assert call.observation == {"role": "tool", "content": "7" * CODE_REPEATS}
    assert answer.reward == ANSWER_REWARD and answer.done
    assert answer.metrics == {"answered_code": 1.0, "used_tool": 1.0}
    sloppy_call, sloppy_answer = episode("?ab", "7xyz")
    assert sloppy_call.reward == pytest.approx(0.8 * CALL_REWARD)
    assert sloppy_answer.reward == pytest.approx(0.7 * ANSWER_REWARD)
    (guess,) = episode("3")  # no call: the first turn is the answer
    assert guess.reward == DIGIT_REWARD and guess.done
    assert guess.metrics == {"answered_code": 0.0, "used_tool": 0.0}
    assert as_step({"metrics": {"x": 1}}).metrics == {"x": 1.0}
    with pytest.raises(EpisodeFailure, match="metrics that are not names -> numbers"):
        as_step({"metrics": {"x": "high"}})
