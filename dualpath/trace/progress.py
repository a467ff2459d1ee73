"""A one-line progress bar on stderr for replays; silent when the stream is not a TTY or
when disabled, so logs and CI output stay clean. No dependency; clock injected."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import IO, Self

from dualpath import clock as _clock


class Progress:
    """``with Progress(total, "rounds") as bar: ... bar.advance()``. Redraws at most every
    ``min_interval_s`` (and always at the end). Owned by one thread."""

    def __init__(self, total: int, label: str = "", *, stream: IO[str] | None = None,
                 enabled: bool | None = None, width: int = 30, min_interval_s: float = 0.1,
                 clock: Callable[[], float] = _clock.now):
        self.total = max(0, int(total))
        self.label = label
        self.done = 0
        self._stream = stream if stream is not None else sys.stderr
        if enabled is None:
            isatty = getattr(self._stream, "isatty", None)
            enabled = bool(isatty and isatty())
        self.enabled = enabled
        self._width = width
        self._min = min_interval_s
        self._clock = clock
        self._t0 = clock()
        self._last: float | None = None
        self._closed = False

    def render(self) -> str:
        frac = self.done / self.total if self.total else 1.0
        fill = round(frac * self._width)
        bar = "#" * fill + "." * (self._width - fill)
        label = f" {self.label}" if self.label else ""
        return (f"\r[{bar}] {self.done}/{self.total}{label} {frac * 100:5.1f}% "
                f"{self._clock() - self._t0:7.1f} s")

    def advance(self, n: int = 1) -> None:
        self.done = min(self.total, self.done + n)
        if not self.enabled:
            return
        now = self._clock()
        if self._last is None or now - self._last >= self._min or self.done == self.total:
            self._stream.write(self.render())
            self._stream.flush()
            self._last = now

    def close(self) -> None:
        """Finish the line. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.enabled:
            self._stream.write(self.render() + "\n")
            self._stream.flush()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
