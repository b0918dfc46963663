"""A save that fails for good, said in one line wherever it failed: on a rank writing its
shard, in a rank's upload thread, or on the controller picking the save's folder.

The rank that meets the error turns it into SaveFailed (step, where, why in a few words,
and whether running the job again later may succeed); Ray hands it to the controller as it
is, and the controller adds which step is the newest complete one (failure_line) before it
stops the run or, with checkpoint.on_failure: continue, warns and trains on.
"""

from __future__ import annotations

import errno
import functools
import os
import shutil
from pathlib import Path
from typing import Any

from rlx.errors import TRY_AGAIN, RlxError
from rlx.storage import (
    StoreUnavailable,
    chain,
    existing_ancestor,
    is_store_url,
    is_transient,
    reason,
)


@functools.cache
def save_errors() -> tuple[type[BaseException], ...]:
    """What a rank's save may fail with that is a failed save (not an interrupt or an exit).
    A function, called in `except save_errors()` (evaluated only when something was raised):
    torch's distributed checkpointing costs a process that never saves about a CPU-second to
    import."""
    from torch.distributed.checkpoint.api import CheckpointException

    # DCP reports a rank's failed write as a CheckpointException, a BaseException
    return (Exception, CheckpointException)


# Free bytes under which a local save's odd failure is taken for a full disk.
FULL_BELOW = 1 << 20


class SaveFailed(RlxError):
    """Step's checkpoint could not be written to `where`; why: a few words (an OS error's
    own, a store's answer). try_again: the store stopped answering (exit 75), not a refusal
    or a full disk (exit 1)."""

    def __init__(self, step: int, where: str, why: str, try_again: bool):
        super().__init__(f"step {step} could not be saved to {where}: {why}")
        self.step, self.where, self.why, self.try_again = step, where, why, try_again
        self.exit_code = TRY_AGAIN if try_again else 1

    def stopping(self, line: str) -> RlxError:
        """The error that stops the run: line (failure_line's), with this failure's exit."""
        error = RlxError(line)
        error.exit_code = self.exit_code
        return error

    def __reduce__(self) -> tuple[Any, ...]:  # crosses Ray as what it is
        return (type(self), (self.step, self.where, self.why, self.try_again))


def underlying(exc: BaseException) -> BaseException:
    """The error behind a wrapper: DCP's CheckpointException holds each rank's own error
    and traceback (in `failures`) rather than chaining it."""
    for error in chain(exc):
        failures = getattr(error, "failures", None)
        if isinstance(failures, dict) and failures:
            first = next(iter(failures.values()))  # (the rank's error, its traceback)
            found = first[0] if isinstance(first, tuple) else getattr(first, "exc", first)
            if isinstance(found, BaseException):
                return found
    return exc


def save_failure(exc: BaseException, step: int, where: Any) -> SaveFailed:
    """exc, met while saving step to where, as the SaveFailed the controller reports."""
    if isinstance(exc, SaveFailed):
        return exc
    cause = underlying(exc)
    try_again = isinstance(cause, StoreUnavailable) or is_transient(cause)
    plain = isinstance(cause, RlxError)  # already worded for the user
    why = str(cause).strip().splitlines()[0] if plain else reason(cause)
    if not isinstance(cause, OSError) and disk_full(where):
        why = os.strerror(errno.ENOSPC)  # torch's writers say it as a failed zip position
    return SaveFailed(step, str(where), why, try_again)


def disk_full(where: Any) -> bool:
    """Whether where is a local folder whose file system has (next to) no room left."""
    if is_store_url(str(where)):
        return False
    try:
        return shutil.disk_usage(existing_ancestor(Path(where))).free < FULL_BELOW
    except OSError:
        return False


def failure_line(failure: SaveFailed, newest: int | None) -> str:
    """The one line of a failed save: what failed, and the step a resume would take."""
    if newest is None:
        return f"{failure}; no checkpoint of this run is complete yet"
    return f"{failure}; step {newest} is the newest complete checkpoint"
