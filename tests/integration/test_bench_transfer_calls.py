"""bench/transfer_calls.py end to end on a short run: the record it writes, and the
property it measures (Python calls per request-layer do not grow with the block count:
a step per block on the transfer path would multiply them at 64 blocks)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import transfer_calls


def test_python_calls_per_request_layer_do_not_grow_with_blocks(tmp_path, capsys):
    out = tmp_path / "calls.json"
    assert transfer_calls.main(["--requests", "3", "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    s = rec["summary"]
    assert s["py_calls_per_request_layer_1"] > 0 and s["c_calls_per_request_layer_1"] > 0
    # Counted, so no timing noise: at 64 blocks a per-block Python step would add
    # hundreds of calls per layer (the old path made 64 Run and 64 slice objects).
    assert s["python_calls_per_request_layer_64_over_1_blocks"] < 1.5
    assert [r["blocks"] for r in rec["rows"]] == [1, 64]
    assert "| 64 |" in capsys.readouterr().out
