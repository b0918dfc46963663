"""The scheduler's warning (SIGUSR1) and SIGTERM (a preemption, a cancelled job, a spot
reclaim) let the step in progress end, then stop with 75 so the job is retried and resumes
from the checkpoint saved on the way out; SIGINT (a person) stops at the next check with
128 + 2."""

from __future__ import annotations

import os
import signal

import pytest

from rlx.trainer.report.console import Stopped, StopRequest, handle_signals


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_warning_and_sigterm_wait_for_the_step_then_stop_with_75(sig: int) -> None:
    with handle_signals(StopRequest()) as stop:
        os.kill(os.getpid(), sig)
        stop.check()  # mid-step: carries on
        assert stop.checkpoint_first and stop.received is not None
        with pytest.raises(Stopped) as info:
            stop.check_between_steps()
    assert info.value.code == 75


def test_sigint_stops_at_the_next_check() -> None:
    with handle_signals(StopRequest()) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert not stop.checkpoint_first
        with pytest.raises(Stopped) as info:
            stop.check()
    assert info.value.code == 128 + signal.SIGINT


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_a_repeated_signal_still_saves_first_but_sigint_after_it_stops_at_once(sig) -> None:
    # Slurm signals every process of the step and `rlx node` forwards the signal as well:
    # the trainer gets it twice, and the second must not skip the checkpoint.
    with handle_signals(StopRequest()) as stop:
        os.kill(os.getpid(), sig)
        os.kill(os.getpid(), sig)
        stop.check()
        assert stop.checkpoint_first
        with pytest.raises(Stopped) as info:
            os.kill(os.getpid(), signal.SIGINT)
    assert info.value.code == 128 + signal.SIGINT


def test_sigterm_after_the_warning_does_not_skip_the_save() -> None:
    # Slurm's time limit: the warning, then SIGTERM when the time is up, maybe mid-save.
    with handle_signals(StopRequest()) as stop:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)
        stop.check()
        with pytest.raises(Stopped) as info:
            stop.check_between_steps()
    assert info.value.code == 75
