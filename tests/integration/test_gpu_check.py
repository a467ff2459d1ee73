"""tools/gpu-check.sh, the one script a GPU machine runs (issue 39 item 5): on a host
without a GPU every part says why it did not run, the record is written with its
summary, and the exit is 0; a usage error exits 2."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "gpu-check.sh"


def test_without_a_gpu_each_part_says_why_and_the_record_is_written(tmp_path):
    if shutil.which("nvidia-smi"):
        pytest.skip("a GPU host: run tools/gpu-check.sh itself (the device script)")
    r = subprocess.run([str(SCRIPT), str(tmp_path)], capture_output=True, text=True,
                       timeout=600, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    rec = json.loads((tmp_path / "gpu-check.json").read_text())
    assert rec["gpus"] == 0 and rec["summary"]["failed"] == []
    assert set(rec["parts"]) == {"tests", "copies", "vllm"}
    for part in rec["parts"].values():
        assert part["result"] == "not run here" and part["detail"], part
    assert "tests    not run here" in r.stdout


def test_a_usage_error_exits_2(tmp_path):
    r = subprocess.run([str(SCRIPT), "a", "b"], capture_output=True, text=True, timeout=60,
                       check=False)
    assert r.returncode == 2 and "usage" in r.stderr
