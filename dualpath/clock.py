"""One clock for benches, the cost model and tests: monotonic seconds as float,
and nanoseconds as int where precision matters."""

from __future__ import annotations

import time

now = time.monotonic
now_ns = time.monotonic_ns


def unix_now() -> float:
    """Wall-clock seconds: the one clock comparable across processes (and, with NTP,
    across nodes), for per-request timings that cross them."""
    return time.time()
