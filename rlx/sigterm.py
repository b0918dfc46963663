"""Ray's daemons outlive a SIGTERM sent to every process of the machine.

A spot reclaim or a VM shutdown signals every process at once: Ray's GCS, raylets and the
workers that host the trainer's actors too. Left to their defaults they die within a
second, and the trainer, which got the same signal to save the step it finished, loses the
actors that hold the state and the GCS it talks through. So our Ray starts with SIGTERM
blocked: a signal mask, unlike a handler, survives fork and exec, and Ray never unblocks it
(it blocks SIGINT the same way), so raylet's workers inherit it too. The signal stays
pending; the trainer saves and exits 75, and whoever started Ray ends it with SIGKILL
(SIGTERM would only wait out a grace).
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator


@contextlib.contextmanager
def held_by_children() -> Iterator[None]:
    """Processes started inside (from this thread) begin with SIGTERM blocked. A SIGTERM
    sent meanwhile to this process is not lost: it arrives when the block ends."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
