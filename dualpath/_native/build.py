"""cffi API-mode build of the C data plane (csrc/) into dualpath._native._dp.

The cdef is the part of csrc/dp.h between the `DP_CDEF_BEGIN` and `DP_CDEF_END` markers:
the header is written for cffi first, so no second copy of the declarations exists.
The package version is compiled in (DP_PKG_VERSION) and checked at import.
"""

from __future__ import annotations

import os
import re
import subprocess
import sysconfig
from pathlib import Path

from cffi import FFI

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"


def _version() -> str:
    text = (ROOT / "dualpath" / "_version.py").read_text()
    return re.search(r'__version__\s*=\s*"([^"]+)"', text).group(1)


def _cdef() -> str:
    text = (CSRC / "dp.h").read_text()
    m = re.search(r"/\* DP_CDEF_BEGIN \*/(.*)/\* DP_CDEF_END \*/", text, re.DOTALL)
    if not m:
        raise RuntimeError("csrc/dp.h has no DP_CDEF_BEGIN/DP_CDEF_END block")
    return m.group(1)


def _probe(snippet: str) -> bool:
    """True when `snippet` compiles against the installed verbs header (a feature probe)."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()
    src = "#include <infiniband/verbs.h>\n" + snippet + "\n"
    r = subprocess.run(cc + ["-x", "c", "-fsyntax-only", "-Werror", "-"],
                       input=src.encode(), capture_output=True, check=False)
    return r.returncode == 0


# Optional rdma-core features, probed at build time (exported as dp_has_dmabuf()).
_FEATURES = [
    ("DP_HAVE_DMABUF", "void *dp_probe(void) { return (void *)ibv_reg_dmabuf_mr; }"),
    ("DP_HAVE_QUERY_GID_EX", ("int dp_probe(struct ibv_context *c, struct ibv_gid_entry *e)"
                              " { return ibv_query_gid_ex(c, 1, 0, e, 0); }")),
]

ffibuilder = FFI()
ffibuilder.cdef(_cdef())
ffibuilder.set_source(
    "dualpath._native._dp",
    '#include "dp.h"\n',
    sources=[str(p.relative_to(ROOT)) for p in sorted(CSRC.glob("*.c"))],
    include_dirs=[str(CSRC)],
    # libcrypto: the TCP handshake's HMAC; libxxhash: block payload hashes (store_io.c)
    libraries=["ibverbs", "pthread", "crypto", "xxhash"],
    define_macros=[("DP_PKG_VERSION", f'"{_version()}"'), ("_GNU_SOURCE", "1")]
    + [(name, "1") for name, snippet in _FEATURES if _probe(snippet)],
    extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Werror",
                        "-Wno-unused-parameter"] + os.environ.get("DP_CFLAGS", "").split(),
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
