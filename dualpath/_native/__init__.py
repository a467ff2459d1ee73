"""The compiled C data plane: ``ffi`` and ``lib`` and nothing else.

The extension embeds the package version it was built from; a mismatch (a stale .so
left behind an upgrade, say under systemd) refuses to load instead of misbehaving.
"""

from __future__ import annotations

from dualpath._version import __version__

try:
    from dualpath._native._dp import ffi, lib
except ImportError as e:  # pragma: no cover - exercised only on broken installs
    raise ImportError(
        f"dualpath's native extension is not built ({e}); run `make install` "
        "(or `pip install -e .`) in the repository"
    ) from e

NATIVE_VERSION = ffi.string(lib.dp_version()).decode()
if NATIVE_VERSION != __version__:
    raise ImportError(
        f"dualpath native extension version {NATIVE_VERSION} does not match the package "
        f"version {__version__}: a stale build is installed; rebuild with `make install`"
    )

__all__ = ["NATIVE_VERSION", "ffi", "lib"]
