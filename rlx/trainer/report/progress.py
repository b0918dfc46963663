"""Progress for rollout collection and steps: a bar on a terminal, a few plain lines in logs."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterable, Iterator
from types import TracebackType
from typing import TextIO, TypeVar

Item = TypeVar("Item")

# Lines per task when the stream is not a terminal: enough to see it move in CI logs.
PLAIN_LINES = 4


class Progress:
    """Counts work done. On a TTY: a tqdm bar that clears when done. Otherwise one line each
    time the count passes another `every` items (a quarter of total by default), and a last
    line with the elapsed time at close."""

    def __init__(
        self,
        total: int | None,
        desc: str,
        *,
        stream: TextIO | None = None,
        every: int | None = None,
    ):
        self.total = total
        self.desc = desc
        self.count = 0
        self._stream = stream if stream is not None else sys.stderr
        self._started = time.monotonic()
        self._bar = None
        if self._stream.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, file=self._stream, leave=False)
        if every is None and total:
            every = max(1, math.ceil(total / PLAIN_LINES))
        self._every = every

    def update(self, n: int = 1) -> None:
        before, self.count = self.count, self.count + n
        if self._bar is not None:
            self._bar.update(n)
            return
        crossed = self._every and before // self._every != self.count // self._every
        if crossed and self.count != self.total:  # the final count is close()'s line
            self._print(self._position())

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self._stream is not None:
            self._print(f"{self._position()} in {time.monotonic() - self._started:.1f}s")
        self._stream = None

    def _position(self) -> str:
        return f"{self.count}/{self.total}" if self.total else str(self.count)

    def _print(self, text: str) -> None:
        print(f"{self.desc}: {text}", file=self._stream, flush=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def track(
    items: Iterable[Item],
    desc: str,
    *,
    total: int | None = None,
    stream: TextIO | None = None,
    every: int | None = None,
) -> Iterator[Item]:
    """Yield items while counting them in a Progress (total from len() when it has one)."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with Progress(total, desc, stream=stream, every=every) as progress:
        for item in items:
            yield item
            progress.update()
