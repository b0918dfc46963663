"""The head's stall watchdog: every step has a deadline, and a run whose step does not finish
within it stops with one line naming the phase and who did not answer, exit 75.

The deadline (trainer.stall_timeout) is a window that opens when the loop starts and again
each time a step finishes. Set, it is that many seconds for every window. Unset, it follows
the step times measured so far:

    before the first step finishes   FIRST_WINDOW_S (the resume, the first weight proof and
                                     generation, a first compile or warm-up)
    after that                       STEP_MULTIPLE x the slowest step so far (the time
                                     between two steps finishing, with its save and its
                                     validation), never under MIN_WINDOW_S

The head never waits without it: every wait on the actors (Cluster's gather, a rollout's
collect) takes the window's remaining time, and the reward function, which runs here on the
head, is called under it (bounded_call). What is left when it passes: the checkpoints already
complete, untouched. Where the learner still answers (the run stalled in the reward, or in the
generation of engines of their own, layout: split) and its last finished step was not saved,
that step is saved then, within a window of its own (SAVE_AT_STALL_S at most), so a retry
loses no finished step; a save that does not finish there leaves the older checkpoints as they
were. The job exits 75 (TRY_AGAIN), so Slurm's requeue and managed recovery run it again, and
it resumes from the last checkpoint.

The training ranks' process groups and the weight group time out too (process_group_timeout),
so a worker blocked in a collective raises instead of waiting for ever.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from rlx.errors import TRY_AGAIN, RlxError

FIRST_WINDOW_S = 1800.0  # until the first step finishes
MIN_WINDOW_S = 600.0  # any later window, at least
STEP_MULTIPLE = 5.0  # later windows: this many times the slowest step so far
SAVE_AT_STALL_S = 600.0  # the save at a stall: at most this long, and at most one window
# The phases in which the learner is idle, holding the last finished step: a stall there may
# save it (generation only where the engines are not in the training ranks' processes).
LEARNER_IDLE = ("reward", "generation")
# The signal that interrupts a reward call on the main thread when its window has passed
# (SIGALRM is math-verify's own limit, SIGUSR1 the scheduler's warning).
INTERRUPT = signal.SIGUSR2
# Test hook: RLX_TEST_HANG_AT=<file>. While the file exists and holds a number n, an engine's
# generate calls after its n-th block until the file is gone: an engine call that never
# returns. Read by the workers, so it is set before their Ray starts.
HANG_HOOK_ENV = "RLX_TEST_HANG_AT"

T = TypeVar("T")


def stall_window(setting: float | None, slowest: float | None) -> float:
    """Seconds the next step may take: the setting when given, else the rule above."""
    if setting is not None:
        return float(setting)
    if slowest is None:
        return FIRST_WINDOW_S
    return max(MIN_WINDOW_S, STEP_MULTIPLE * slowest)


def process_group_timeout(setting: float | None) -> float:
    """Seconds a collective of the training ranks, or a weight push, may wait for a peer:
    trainer.stall_timeout when set, else the first window's (the longest a step may take
    before any was measured)."""
    return float(setting) if setting is not None else FIRST_WINDOW_S


def rule_text(setting: float | None) -> str:
    if setting is not None:
        return "trainer.stall_timeout"
    return (
        f"trainer.stall_timeout unset: {STEP_MULTIPLE:g} x the slowest step so far, at least "
        f"{MIN_WINDOW_S:g} s, {FIRST_WINDOW_S:g} s until the first step finishes"
    )


class Stalled(RlxError):
    """No step finished within the window: worth running again (exit 75)."""

    exit_code = TRY_AGAIN

    def __init__(self, step: int, phase: str, window: float, unanswered: Sequence[str], rule: str):
        self.step = step
        self.phase = phase
        self.window = window
        self.unanswered = list(unanswered)
        self.rule = rule
        super().__init__(self.line(None))

    def with_line(self, resumes_at: int | None, checkpoints: bool = True) -> Stalled:
        """The same stall, its message saying what a retry resumes from."""
        again = Stalled(self.step, self.phase, self.window, self.unanswered, self.rule)
        again.args = (again.line(resumes_at, checkpoints),)
        return again

    def line(self, resumes_at: int | None, checkpoints: bool = True) -> str:
        """The run's one line: the step, the phase, who did not answer, what a retry does."""
        who = "; did not answer: " + ", ".join(self.unanswered) if self.unanswered else ""
        if not checkpoints:
            after = "no checkpoint.dir, so a retry starts at step 0"
        elif resumes_at is None:
            after = "no checkpoint was complete yet, so a retry starts at step 0"
        else:
            after = f"step {resumes_at}'s checkpoint is kept and a retry resumes there"
        return (
            f"step {self.step} stalled in the {self.phase}: nothing finished within "
            f"{self.window:.0f} s ({self.rule}){who}; {after}; exit {TRY_AGAIN} so the job is "
            "run again"
        )


class StallClock:
    """The window the head's waits share (see the module docstring)."""

    def __init__(self, setting: float | None, now: Callable[[], float] = time.monotonic):
        self.setting = setting
        self.now = now
        self.slowest: float | None = None
        self.step = 1  # the step under way
        self.phase = "start-up"
        self.opened = now()
        self.window = stall_window(setting, None)

    def step_done(self, step: int) -> None:
        """Step `step` finished: its time counts, and the next step's window opens."""
        now = self.now()
        took = now - self.opened
        self.slowest = took if self.slowest is None else max(self.slowest, took)
        self.opened = now
        self.window = stall_window(self.setting, self.slowest)
        self.step = step + 1

    def reopen(self, window: float) -> None:
        """A window of `window` seconds from now, for what follows a stall (its save)."""
        self.opened = self.now()
        self.window = window

    def remaining(self) -> float:
        return max(0.0, self.opened + self.window - self.now())

    @contextlib.contextmanager
    def phase_of(self, name: str) -> Iterator[None]:
        """The phase the head is in, for the line; the one before it again afterwards."""
        before, self.phase = self.phase, name
        try:
            yield
        finally:
            self.phase = before

    def overdue(self, unanswered: Sequence[str]) -> Stalled:
        return Stalled(self.step, self.phase, self.window, unanswered, rule_text(self.setting))


class CollectiveFailed(RlxError):
    """A collective of the training ranks that failed or waited past its timeout: a peer
    gone or stuck. Worth running again (exit 75)."""

    exit_code = TRY_AGAIN


# What gloo and NCCL say when a peer is gone or silent.
_COLLECTIVE_WORDS = ("gloo", "nccl", "timed out", "connection closed by peer", "connection reset")


def collective_failure(exc: BaseException, rank: int, where: str, phase: str, timeout: float):
    """CollectiveFailed for a training rank's error that a collective raised (its peer, when
    the backend names it, is in the first line), else None."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    if not any(word in text.lower() for word in _COLLECTIVE_WORDS):
        return None
    return CollectiveFailed(
        f"training rank {rank} on {where}, in the {phase}: a collective with the other "
        f"training ranks failed or waited past {timeout:.0f} s: {first}; the run stops "
        f"here, exit {TRY_AGAIN} so it is run again from its last checkpoint"
    )


class _Interrupted(BaseException):
    """Raised in the main thread by INTERRUPT: a BaseException, so that a reward's own
    `except Exception` does not swallow it."""


def bounded_call(fn: Callable[[], T], clock: StallClock | None, who: Callable[[], str]) -> T:
    """fn() within the clock's remaining window, or clock.overdue([who()]).

    On the main thread fn runs right there (a reward may use signal alarms of its own, as
    math-verify does; they work only there), and a timer thread interrupts it with INTERRUPT
    when the window passes: the call stops at its next Python instruction, or when the
    system call it waits in returns. Native code that never returns to the interpreter is
    not interrupted; the job's own time limit is what ends that. Elsewhere fn runs in a
    daemon thread that is waited for until the window passes; a call that never returns is
    left there, blocked, and ends with the process, which exits 75 soon after."""
    if clock is None:
        return fn()
    if threading.current_thread() is threading.main_thread():
        return _on_main_thread(fn, clock, who)
    return _in_a_thread(fn, clock, who)


def _on_main_thread(fn: Callable[[], T], clock: StallClock, who: Callable[[], str]) -> T:
    armed = threading.Event()

    def interrupt(signum: int, frame: Any) -> None:
        if armed.is_set():
            armed.clear()
            raise _Interrupted

    previous = signal.signal(INTERRUPT, interrupt)
    main = threading.main_thread().ident
    assert main is not None
    timer = threading.Timer(clock.remaining(), signal.pthread_kill, (main, INTERRUPT))
    timer.daemon = True
    armed.set()
    try:
        timer.start()
        return fn()
    except _Interrupted:
        raise clock.overdue([who()]) from None
    finally:
        armed.clear()  # a late interrupt finds it clear and does nothing
        timer.cancel()
        signal.signal(INTERRUPT, previous)


def _in_a_thread(fn: Callable[[], T], clock: StallClock, who: Callable[[], str]) -> T:
    outcome: list[Any] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            outcome.append(fn())
        except BaseException as exc:  # handed to the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=run, name="rlx-bounded-call", daemon=True)
    thread.start()
    thread.join(clock.remaining())
    if thread.is_alive():
        raise clock.overdue([who()])
    if failure:
        raise failure[0]
    return outcome[0]


def hang_if_asked(calls: int) -> None:
    """The test hook above, in an engine's generate: `calls` is this call's number (1..)."""
    spec = os.environ.get(HANG_HOOK_ENV)
    if not spec:
        return
    marker = Path(spec)
    with contextlib.suppress(OSError, ValueError):
        if calls > int(marker.read_text().strip()):
            while marker.exists():
                time.sleep(0.2)
