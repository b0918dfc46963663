"""The scheduler's warning (SIGUSR1) lets the step in progress end, then stops with 75 so the
job requeues; SIGTERM stops at the next check with 128 + 15."""

from __future__ import annotations

import os
import signal

import pytest

from rlx.trainer.report.console import Stopped, StopRequest, handle_signals


def test_warning_waits_for_the_step_then_stops_with_75() -> None:
    with handle_signals(StopRequest()) as stop:
        os.kill(os.getpid(), signal.SIGUSR1)
        stop.check()  # mid-step: carries on
        assert stop.checkpoint_first
        with pytest.raises(Stopped) as info:
            stop.check_between_steps()
    assert info.value.code == 75


def test_sigterm_stops_at_the_next_check() -> None:
    with handle_signals(StopRequest()) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert not stop.checkpoint_first
        with pytest.raises(Stopped) as info:
            stop.check()
    assert info.value.code == 128 + signal.SIGTERM


def test_a_repeated_warning_still_saves_first_but_sigterm_after_it_stops_at_once() -> None:
    # Slurm signals every process of the step and `rlx node` forwards the warning as well:
    # the trainer gets USR1 twice, and the second must not skip the checkpoint.
    with handle_signals(StopRequest()) as stop:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)
        stop.check()
        assert stop.checkpoint_first
        with pytest.raises(Stopped) as info:
            os.kill(os.getpid(), signal.SIGTERM)
    assert info.value.code == 128 + signal.SIGTERM
