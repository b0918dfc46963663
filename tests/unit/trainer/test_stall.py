"""The stall watchdog's parts: the window's rule, the clock the head's waits share, the one
line a stall ends the run with, the bounded reward call, and the recipe's field."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from rlx.errors import TRY_AGAIN, RecipeError
from rlx.recipe.load import parse_recipe
from rlx.trainer.stall import (
    FIRST_WINDOW_S,
    INTERRUPT,
    MIN_WINDOW_S,
    STEP_MULTIPLE,
    StallClock,
    Stalled,
    bounded_call,
    collective_failure,
    process_group_timeout,
    stall_window,
)


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_window_is_the_setting_or_a_multiple_of_the_slowest_step():
    assert stall_window(45, None) == 45 and stall_window(45, 1000) == 45
    assert stall_window(None, None) == FIRST_WINDOW_S == 1800  # start-up, first generation
    assert stall_window(None, 10) == MIN_WINDOW_S == 600  # never under the floor
    assert stall_window(None, 300) == STEP_MULTIPLE * 300 == 1500
    # The collectives' timeout: the setting, else the longest window before any was measured.
    assert process_group_timeout(45) == 45 and process_group_timeout(None) == FIRST_WINDOW_S


def test_the_clock_opens_a_window_per_step_from_the_slowest_so_far():
    clock_time = FakeTime()
    clock = StallClock(None, now=clock_time)
    assert clock.window == FIRST_WINDOW_S and clock.remaining() == FIRST_WINDOW_S
    clock_time.now += 400  # the first step: start-up and a first generation
    clock.step_done(1)
    assert clock.step == 2 and clock.slowest == 400 and clock.window == 2000
    clock_time.now += 50
    clock.step_done(2)
    assert clock.slowest == 400 and clock.window == 2000  # the slowest, not the last
    clock_time.now += 1990
    assert clock.remaining() == pytest.approx(10)
    clock_time.now += 20
    assert clock.remaining() == 0

    fixed = StallClock(30, now=clock_time)
    clock_time.now += 1000
    fixed.step_done(1)
    assert fixed.window == 30  # a setting holds whatever the steps took


def test_the_phase_is_the_innermost_and_comes_back():
    clock = StallClock(30)
    with clock.phase_of("training ranks' update"):
        with clock.phase_of("weight push"):
            assert clock.phase == "weight push"
        assert clock.phase == "training ranks' update"
    assert clock.phase == "start-up"


def test_a_stall_is_one_line_naming_step_phase_who_and_the_resume():
    clock = StallClock(20)
    clock.step = 3
    with clock.phase_of("reward"):
        stall = clock.overdue(["reward function rewards:hangs (sample 5 of 8)"])
    assert isinstance(stall, Stalled) and stall.exit_code == TRY_AGAIN == 75
    line = str(stall.with_line(2))
    assert "\n" not in line
    assert line.startswith("step 3 stalled in the reward: nothing finished within 20 s")
    assert "(trainer.stall_timeout)" in line
    assert "did not answer: reward function rewards:hangs (sample 5 of 8)" in line
    assert "step 2's checkpoint is kept and a retry resumes there" in line
    assert line.endswith("exit 75 so the job is run again")
    assert "retry starts at step 0" in str(stall.with_line(None))
    assert "no checkpoint.dir" in str(stall.with_line(None, checkpoints=False))
    assert stall.with_line(2).exit_code == TRY_AGAIN

    ranks = StallClock(None).overdue(["training rank 1 on 10.0.0.2", "rollout worker 0 on x"])
    line = str(ranks)
    assert "did not answer: training rank 1 on 10.0.0.2, rollout worker 0 on x" in line
    assert "5 x the slowest step so far" in line and "1800 s until the first step" in line


def hang(seconds: float = 30.0) -> float:
    try:
        time.sleep(seconds)
    except Exception:  # a reward's own catch-all must not swallow the stop
        return 0.0
    return 1.0


def test_a_call_on_the_main_thread_is_interrupted_when_the_window_passes():
    assert threading.current_thread() is threading.main_thread()
    before = signal.getsignal(INTERRUPT)
    clock = StallClock(0.5)
    clock.phase = "reward"
    started = time.monotonic()
    with pytest.raises(Stalled) as caught:
        bounded_call(hang, clock, lambda: "reward function hang (sample 0 of 1)")
    assert time.monotonic() - started < 5
    assert "did not answer: reward function hang (sample 0 of 1)" in str(caught.value)
    assert signal.getsignal(INTERRUPT) is before  # the handler is put back
    # In time: its value; its own error: as it is; no clock: a plain call.
    assert bounded_call(lambda: 7, StallClock(30), str) == 7
    with pytest.raises(ZeroDivisionError):
        bounded_call(lambda: 1 / 0, StallClock(30), str)
    assert bounded_call(lambda: 8, None, str) == 8
    time.sleep(0.1)  # a late timer finds nothing armed


def test_a_call_off_the_main_thread_is_left_behind_when_the_window_passes():
    outcome: list[object] = []

    def caller() -> None:
        try:
            outcome.append(bounded_call(hang, StallClock(0.3), lambda: "reward"))
        except Stalled as stall:
            outcome.append(stall)
        try:
            outcome.append(bounded_call(lambda: 1 / 0, StallClock(30), str))
        except ZeroDivisionError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=caller)
    started = time.monotonic()
    thread.start()
    thread.join(10)
    assert time.monotonic() - started < 5
    assert isinstance(outcome[0], Stalled) and isinstance(outcome[1], ZeroDivisionError)
    # the blocked call stays in a daemon thread: it does not hold the process at exit
    assert all(t.daemon for t in threading.enumerate() if t.name == "rlx-bounded-call")


def trainer_recipe(extra: str) -> str:
    return (
        "name: job\ncommand: [echo]\ntrainer:\n  model: {path: m}\n  data: {train: d.jsonl}\n"
        + extra
    )


def test_stall_timeout_in_the_recipe():
    recipe = parse_recipe(trainer_recipe("")).recipe
    assert recipe.trainer is not None and recipe.trainer.stall_timeout is None
    recipe = parse_recipe(trainer_recipe("  stall_timeout: 90\n")).recipe
    assert recipe.trainer is not None and recipe.trainer.stall_timeout == 90


@pytest.mark.parametrize("value", ["-5", "0"])
def test_a_stall_timeout_not_above_zero_is_one_line(value: str):
    with pytest.raises(RecipeError) as caught:
        parse_recipe(trainer_recipe(f"  stall_timeout: {value}\n"))
    (finding,) = caught.value.findings
    line = finding.format()
    assert line.startswith("<recipe>:6: error: trainer.stall_timeout: ")
    assert "more than 0" in line and "leave it unset" in line and "\n" not in line


def test_a_collective_that_timed_out_is_one_line_naming_rank_node_and_phase():
    exc = RuntimeError(
        "[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 900000ms for recv "
        "operation to complete\nmore"
    )
    failed = collective_failure(exc, 1, "10.0.0.2", "update", 900)
    assert failed is not None and failed.exit_code == TRY_AGAIN
    line = str(failed)
    assert "\n" not in line
    assert line.startswith("training rank 1 on 10.0.0.2, in the update: a collective with the")
    assert "waited past 900 s: [../gloo/transport/tcp/unbound_buffer.cc:78] Timed out" in line
    assert collective_failure(RuntimeError("CUDA out of memory"), 1, "x", "update", 9) is None
