"""An event loop that stops running callbacks, noticed and located.

A daemon's event loop answers its leases, its peers' RPCs and its fences' timers. When
something on the loop's thread blocks it (a synchronous call, a long computation), every
one of those is late at once: a lease lost, a deadline missed, a peer given up on, and
nothing in the logs says why. :class:`StallWatch` is a thread that asks the loop to run a
no-op every ``period_s``; when the loop has not run one for ``threshold_s`` it logs, once
per stall, the Python stack of the loop's thread (where it is blocked), and when the
loop runs again, how long the stall lasted. ``on_stall(seconds)`` counts each one
(metrics). The thread only reads: it never touches the loop's state.

A C call that keeps the GIL stops every Python thread, this one too: then nobody can
look. For that the thread keeps :func:`faulthandler.dump_traceback_later` armed two
thresholds ahead (its timer is a C thread that needs no GIL): if this thread has not
re-armed it by then, every thread's stack goes to stderr, the holder's among them, and
once this thread runs again it logs how long the process ran no Python (a SIGSTOP looks
the same).
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable

log = logging.getLogger("dualpath.stall")


class StallWatch:
    """See the module docstring. Start it from the loop's own thread; ``close()`` is
    idempotent."""

    def __init__(self, name: str, threshold_s: float = 1.0, period_s: float = 0.5,
                 on_stall: Callable[[float], None] | None = None):
        self.name = name
        self.threshold_s = threshold_s
        self.period_s = period_s
        self.on_stall = on_stall
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._last = 0.0                 # monotonic time the loop last ran our no-op
        self._stalled_since = 0.0        # set while a stall is being reported
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> StallWatch:
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._last = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"stall-watch-{self.name}",
                                        daemon=True)
        self._thread.start()
        return self

    def _arm(self) -> None:
        """Every thread's stack to the process's stderr if this thread does not call
        again within two thresholds (a no-op where stderr is no file)."""
        try:
            faulthandler.dump_traceback_later(2 * self.threshold_s, file=sys.__stderr__)
        except (AttributeError, ValueError, OSError):
            pass

    def _pong(self) -> None:
        self._last = time.monotonic()

    def _run(self) -> None:
        assert self._loop is not None
        tick = time.monotonic()
        while True:
            self._arm()
            if self._stop.wait(self.period_s):
                return
            now = time.monotonic()
            if now - tick > self.period_s + self.threshold_s:
                log.warning("%s: no Python thread ran for %.1f s (a C call holding the "
                            "GIL, the process stopped, or the host starved)%s", self.name,
                            now - tick - self.period_s,
                            "; every thread's stack is above" if now - tick - self.period_s
                            > 2 * self.threshold_s else "")
                if self.on_stall is not None:
                    self.on_stall(now - tick - self.period_s)
                self._last = now         # the loop had no chance either: not its stall
            tick = now
            try:
                self._loop.call_soon_threadsafe(self._pong)
            except RuntimeError:         # the loop closed
                return
            last = self._last
            if now - last > self.threshold_s:
                if not self._stalled_since:
                    self._stalled_since = last
                    frame = sys._current_frames().get(self._loop_thread)
                    where = "".join(traceback.format_stack(frame)[-12:]) if frame else "?"
                    log.warning("%s: event loop blocked for %.1f s; its thread is at:\n%s",
                                self.name, now - last, where.rstrip())
            elif self._stalled_since:
                took = last - self._stalled_since
                self._stalled_since = 0.0
                log.warning("%s: event loop ran again after %.1f s", self.name, took)
                if self.on_stall is not None:
                    self.on_stall(took)

    def close(self) -> None:
        self._stop.set()
        faulthandler.cancel_dump_traceback_later()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.period_s + 1)
        self._thread = None
