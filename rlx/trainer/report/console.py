"""The run's console: everything printed is copied to the run's log file (progress bars stay
on the terminal); and SIGTERM/SIGINT, which stop the run at the next safe point so the
actors are released and the run's record says it was stopped."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from rlx.errors import TRY_AGAIN


class Stopped(Exception):
    """SIGTERM or SIGINT arrived: stop, release the actors, exit 128 + signal."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        # USR1 is the scheduler's warning (Slurm --signal), SIGTERM how every scheduler and
        # cloud stops a node (preemption, a spot reclaim, a cancelled job): both checkpoint
        # first and are worth a retry. SIGINT is a person stopping the run: 130, no retry.
        self.code = TRY_AGAIN if signum in SAVE_FIRST else 128 + signum


# --------------------------------------------------------------------------- console


class _Tee(io.TextIOBase):
    """Writes to the console stream and to the run's log file."""

    def __init__(self, stream: TextIO, log: TextIO):
        self._stream = stream
        self._log = log

    def write(self, text: str) -> int:
        self._stream.write(text)
        # Libraries imported during the run (Ray's colorama) keep this object as their
        # stdout and write to it at exit, after the log is closed: the console only, then.
        if not self._log.closed:
            self._log.write(text)
        return len(text)

    def flush(self) -> None:
        self._stream.flush()
        if not self._log.closed:
            self._log.flush()

    def isatty(self) -> bool:
        return self._stream.isatty()


class _AboveBars(io.TextIOBase):
    """Lines printed while a progress bar is on the terminal go above it, not through it."""

    def __init__(self, stream: TextIO, bar_stream: TextIO):
        self._stream = stream
        self._bar_stream = bar_stream

    def write(self, text: str) -> int:
        from tqdm import tqdm

        with tqdm.external_write_mode(file=self._bar_stream):
            self._stream.write(text)
            self._stream.flush()
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        return self._stream.isatty()


@contextlib.contextmanager
def console_to_log(log_path: Path) -> Iterator[tuple[TextIO, TextIO]]:
    """(out, err) for the run: both copied to log_path. Progress bars (err on a terminal)
    stay on the terminal only."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    real_out, real_err = sys.stdout, sys.stderr
    with open(log_path, "a", encoding="utf-8", buffering=1) as log:
        out: TextIO = _Tee(real_out, log)  # type: ignore[assignment]
        tee_err: TextIO = _Tee(real_err, log)  # type: ignore[assignment]
        sys.stdout, sys.stderr = out, tee_err
        try:
            if real_err.isatty():
                yield _AboveBars(out, real_err), real_err  # type: ignore[misc]
            else:
                yield out, tee_err
        finally:
            sys.stdout, sys.stderr = real_out, real_err


# Signals after which the step in progress ends, a checkpoint is saved, and the run exits
# 75. The deadline this must meet is the platform's grace before SIGKILL (GCP spot: 30 s;
# Slurm: KillWait; SkyPilot/dstack: their own); docs/storage.md has what was measured.
SAVE_FIRST = (signal.SIGUSR1, signal.SIGTERM)
# Once a stop's checkpoint is durable, Ray's teardown gets this long, then the process leaves
# with 75 regardless: a driver whose GCS is gone waits 60 s for it and then dies with 1, past
# every platform's grace and with the wrong code for a retry.
LEAVE_AFTER_SAVED_SECONDS = 10.0


class StopRequest:
    """Set by SIGTERM, SIGUSR1 or SIGINT; the loop calls check() between phases and stops.

    SIGTERM and SIGUSR1 (the scheduler's warning) let the step in progress end, save, and
    stop with 75; SIGINT (Ctrl-C, `rlx down` on this machine) stops at the next check.

    The handler does not raise: an exception thrown from inside Ray's C++ calls (ray.wait,
    ray.get) comes out mangled. A SIGINT after any first signal stops at once, for a start-up
    or a save that hangs; so does a SIGTERM after SIGINT. A repeated SIGTERM or warning does
    not: schedulers signal every process of a job and the node forwards it, so the trainer
    usually gets it twice, and the second must not skip the checkpoint.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self.received: float | None = None  # time.monotonic() when the first signal came
        self._leave: threading.Timer | None = None

    def handler(self, signum: int, _frame: object) -> None:
        if self.signum is not None:
            if signum in SAVE_FIRST and self.signum in SAVE_FIRST:
                # The same request again: Slurm signals every process of the step and the
                # node forwards it too, so it usually arrives twice. Still save first.
                return
            raise Stopped(signum)
        self.signum = signum
        self.received = time.monotonic()

    def check(self) -> None:
        """Stop here on SIGTERM/SIGINT; the warning (USR1) lets the step in progress end."""
        if self.signum is not None and not self.checkpoint_first:
            raise Stopped(self.signum)

    def check_between_steps(self) -> None:
        if self.signum is not None:
            raise Stopped(self.signum)

    def leave_soon(self, seconds: float = LEAVE_AFTER_SAVED_SECONDS) -> None:
        """The stop's save is done: exit 75 in `seconds` unless stay() comes first."""
        if self._leave is None:
            self._leave = threading.Timer(seconds, _leave, (seconds,))
            self._leave.daemon = True
            self._leave.start()

    def stay(self) -> None:
        """What leave_soon waited for is done (Ray let go)."""
        if self._leave is not None:
            self._leave.cancel()

    @property
    def checkpoint_first(self) -> bool:
        """Save what was done before stopping (SIGTERM, or the scheduler's warning)."""
        return self.signum in SAVE_FIRST


def _leave(seconds: float) -> None:
    print(
        f"Ray did not let go within {seconds:.0f} s of the stop; leaving with {TRY_AGAIN}",
        flush=True,
    )
    os._exit(TRY_AGAIN)


@contextlib.contextmanager
def handle_signals(request: StopRequest) -> Iterator[StopRequest]:
    """Route SIGTERM and SIGINT to `request` (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    handled = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
    previous = {s: signal.signal(s, request.handler) for s in handled}
    # Started by a Ray worker (a Ray Job's entrypoint), this process inherits SIGTERM and
    # SIGINT blocked (rlx.sigterm; Ray's own for SIGINT) and would never see a stop.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, handled)
    try:
        yield request
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
