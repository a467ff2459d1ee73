"""The C library, loaded once for the calls Python's os module lacks (mlock,
sync_file_range, adjtimex, prctl); errno kept for ``ctypes.get_errno()``."""

from __future__ import annotations

import ctypes

LIBC = ctypes.CDLL(None, use_errno=True)
