"""Work in a thread of its own that a process goes on beside: a checkpoint's upload, a
queued weight push. A leaf."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class Background:
    """Work in a thread of its own (a save's upload, a queued weight push); result() waits for
    it and gives its value, or raises what it raised."""

    def __init__(self, work: Callable[[], Any], name: str = "rlx-checkpoint-upload"):
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(work,), name=name, daemon=True)
        self._thread.start()

    def _run(self, work: Callable[[], Any]) -> None:
        try:
            self._value = work()
        except BaseException as exc:  # handed to whoever waits
            self._error = exc

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value
