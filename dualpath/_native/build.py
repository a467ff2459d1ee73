"""cffi API-mode build of the C data plane (csrc/) into dualpath._native._dp.

The cdef is the part of csrc/dp.h between the `DP_CDEF_BEGIN` and `DP_CDEF_END` markers:
the header is written for cffi first, so no second copy of the declarations exists.
The package version is compiled in (DP_PKG_VERSION) and checked at import.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from cffi import FFI

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"


def _version() -> str:
    text = (ROOT / "dualpath" / "_version.py").read_text()
    return re.search(r'__version__\s*=\s*"([^"]+)"', text).group(1)


def _cdef() -> str:
    text = (CSRC / "dp.h").read_text()
    m = re.search(r"/\* DP_CDEF_BEGIN \*/(.*)/\* DP_CDEF_END \*/", text, re.S)
    if not m:
        raise RuntimeError("csrc/dp.h has no DP_CDEF_BEGIN/DP_CDEF_END block")
    return m.group(1)


ffibuilder = FFI()
ffibuilder.cdef(_cdef())
ffibuilder.set_source(
    "dualpath._native._dp",
    '#include "dp.h"\n',
    sources=[str(p.relative_to(ROOT)) for p in sorted(CSRC.glob("*.c"))],
    include_dirs=[str(CSRC)],
    libraries=["ibverbs", "pthread"],
    define_macros=[("DP_PKG_VERSION", '"%s"' % _version()), ("_GNU_SOURCE", "1")],
    extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Werror",
                        "-Wno-unused-parameter"] + os.environ.get("DP_CFLAGS", "").split(),
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
