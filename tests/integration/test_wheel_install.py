"""The package as a user gets it: `python -m build` (an sdist, then a wheel built from that
sdist, as pip does) from the sources a clone has, the wheel installed into a fresh venv
(dependencies from PyPI), then that venv's own `dualpath` run from outside the checkout:
the import resolves to site-packages, `--version` names the package and its native
extension, `config check` judges a config, and a node starts and stops on SIGTERM."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from dualpath._version import __version__
from tests.integration.test_sched_cli import DaemonLog, stops_cleanly

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
VERSION = __version__


def _prerequisites() -> str | None:
    try:
        import build  # noqa: F401
    except ImportError:
        return "needs `build` (the test extra: pip install -e '.[test]')"
    if not shutil.which("git") or not (ROOT / ".git").exists():
        return "needs a git checkout to copy the sources a clone has"
    cc = subprocess.run(["cc", "-x", "c", "-fsyntax-only", "-"], check=False,
                        input=b"#include <infiniband/verbs.h>\n", capture_output=True)
    if cc.returncode != 0:
        return "needs a C compiler and rdma-core's headers (libibverbs-dev)"
    return None


def _run(argv, *, timeout: float, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False,
                       **kw)
    assert r.returncode == 0, f"{argv} exited {r.returncode}:\n{r.stdout[-3000:]}\n" \
                              f"{r.stderr[-3000:]}"
    return r


def _clone_sources(dest: Path) -> None:
    """The tracked and untracked-but-not-ignored files: what a clone of this tree holds
    (no generated stubs, no compiled extension, no egg-info), so the build starts bare."""
    names = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                 cwd=ROOT, timeout=60).stdout.split("\0")
    for name in filter(None, names):
        src = ROOT / name
        if src.is_file():       # a tracked file deleted in the work tree is not there
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A fresh venv with the wheel built from the sdist installed; its bin/ directory."""
    why = _prerequisites()
    if why:
        pytest.skip(why)
    d = tmp_path_factory.mktemp("package")
    src, dist = d / "src", d / "dist"
    _clone_sources(src)
    # No --sdist/--wheel: build makes the sdist, then the wheel from the unpacked sdist.
    _run([sys.executable, "-m", "build", "--outdir", str(dist), str(src)], timeout=600)
    sdists, wheels = list(dist.glob("*.tar.gz")), list(dist.glob("*.whl"))
    assert [p.name for p in sdists] == [f"dualpath-{VERSION}.tar.gz"]
    assert len(wheels) == 1 and wheels[0].name.startswith(f"dualpath-{VERSION}-cp")

    with tarfile.open(sdists[0]) as t:
        in_sdist = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    for need in ("csrc/dp.h", "csrc/tcp_internal.h", "csrc/verbs_internal.h",
                 "csrc/tcp_dp.c", "csrc/tcp_target.c", "csrc/tcp_sock.c", "proto/dualpath/v1/scheduler.proto", "tools/gen_proto.py",
                 "dualpath/_native/build.py", "setup.py", "pyproject.toml", "README.md"):
        assert need in in_sdist, f"sdist lacks {need}"
    assert not any(n.startswith("dualpath/v1/") for n in in_sdist)   # generated at build

    with zipfile.ZipFile(wheels[0]) as z:
        in_wheel = set(z.namelist())
    assert any(re.fullmatch(r"dualpath/_native/_dp\..*\.so", n) for n in in_wheel), in_wheel
    assert {"dualpath/v1/scheduler_pb2.py", "dualpath/v1/scheduler_pb2_grpc.py",
            "dualpath/v1/node_pb2_grpc.py"} <= in_wheel

    env = d / "venv"
    _run([sys.executable, "-m", "venv", str(env)], timeout=300)
    _run([str(env / "bin" / "python"), "-m", "pip", "install", "-q",
          "--disable-pip-version-check", str(wheels[0])], timeout=600)
    return env / "bin"


@pytest.fixture
def outside(tmp_path) -> dict:
    """Keyword arguments for running from a directory outside the checkout, with nothing
    in the environment pointing back at it."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    return {"cwd": tmp_path, "env": env}


def test_import_resolves_to_the_venv(venv, outside):
    code = ("import dualpath, dualpath._native, dualpath.v1.scheduler_pb2_grpc as g; "
            "print(dualpath.__file__); print(g.__file__)")
    r = _run([str(venv / "python"), "-c", code], timeout=120, **outside)
    site = venv.parent / "lib"
    for path in r.stdout.split():
        assert Path(path).is_relative_to(site), r.stdout


def test_version_names_package_and_native_extension(venv, outside):
    out = _run([str(venv / "dualpath"), "--version"], timeout=120, **outside).stdout
    assert re.match(rf"dualpath {re.escape(VERSION)}; native extension "
                    rf"{re.escape(VERSION)} \(", out), out


def _node_config(d: Path) -> Path:
    cfg = d / "node.toml"
    cfg.write_text(f'[storage]\ndir = "{d / "kv"}"\n[transport]\nkind = "tcp"\n'
                   "[buffers]\npe_buffer_mib = 8\nmlock = false\n"
                   '[engine]\nprefill_hbm_mib = 16\nmetrics_listen = "127.0.0.1:0"\n'
                   "[tls]\nplaintext = true\n")
    return cfg


def test_config_check(venv, outside, tmp_path):
    cfg = _node_config(tmp_path)
    r = _run([str(venv / "dualpath"), "config", "check", str(cfg)], timeout=120, **outside)
    assert r.stdout.strip() == f"{cfg}: ok"
    bad = tmp_path / "bad.toml"
    bad.write_text('[transport]\nkind = "ib"\n')
    r = subprocess.run([str(venv / "dualpath"), "config", "check", str(bad)], check=False,
                       capture_output=True, text=True, timeout=120, **outside)
    assert r.returncode == 2 and "transport.kind" in r.stderr, r.stderr


def test_node_starts_and_stops_on_sigterm(venv, outside, tmp_path):
    # A prefill node on the TCP provider (the compiled extension), its scheduler absent
    # (nothing listens on port 1): it comes up, and SIGTERM ends it with exit 0.
    cfg = _node_config(tmp_path)
    proc = subprocess.Popen([str(venv / "dualpath"), "node", "--role", "prefill",
                             "--node-id", "p0", "--scheduler", "127.0.0.1:1",
                             "--config", str(cfg)],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            **outside)
    try:
        log = DaemonLog(proc)
        line = log.wait_for(r"prefill node p0 up: .*").group(0)
        assert re.search(r"transport tcp \(tcp listening on 127\.0\.0\.1:\d+", line), line
        stops_cleanly(proc, log, "p0")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
