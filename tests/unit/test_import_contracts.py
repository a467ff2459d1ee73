"""The import contracts `make lint` checks (pyproject.toml, import-linter) hold on the
tree and fail on an upward import: a copy of the package with one low module importing
the cluster tools is refused, naming the import."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT = Path(sys.executable).with_name("lint-imports")


def lint(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT), "--no-cache", "--config", str(root / "pyproject.toml")],
                          check=False, cwd=root, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture
def tree(tmp_path):
    if not LINT.exists():
        pytest.fail(f"{LINT} is missing: make install installs import-linter")
    shutil.copytree(ROOT / "dualpath", tmp_path / "dualpath",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    return tmp_path


def test_the_tree_keeps_its_contracts(tree):
    r = lint(tree)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "3 kept, 0 broken" in r.stdout


@pytest.mark.parametrize("module, imports, says", [
    ("kv/cost.py", "dualpath.cluster.local",
     "dualpath.kv is not allowed to import dualpath.cluster"),
    ("vllm/agent.py", "dualpath.node.daemon",
     "dualpath.vllm is not allowed to import dualpath.node"),
    ("paths/prefill.py", "dualpath.engines.emulated.engine",
     "dualpath.paths is not allowed to import dualpath.engines"),
    ("engines/protocol.py", "dualpath.node.daemon",
     "dualpath.engines is not allowed to import dualpath.node"),
    ("vllm/worker_side.py", "dualpath.paths.kvplan",
     "dualpath.vllm is not allowed to import dualpath.paths"),
    ("scheduler/render.py", "dualpath.scheduler.top",
     "No cycles are allowed in dualpath.scheduler"),
])
def test_an_upward_import_or_a_cycle_breaks_them(tree, module, imports, says):
    path = tree / "dualpath" / module
    path.write_text(path.read_text() + f"\nimport {imports}  # noqa\n")
    r = lint(tree)
    assert r.returncode != 0
    assert says in r.stdout, r.stdout
