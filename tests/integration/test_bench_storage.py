"""bench/storage.py end to end on a tiny file set: every row it promises is measured
(the store's paths, its C read loop alone at fio's buffer footprint and at the pool's,
fio beside them) and the record's summary carries the ratios."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.bench_module import ROOT, load_bench


@pytest.mark.skipif(not shutil.which("fio"),
                    reason="fio is needed (tools/install-system-packages.sh)")
def test_storage_bench_measures_the_c_loop_beside_fio(tmp_path, capsys):
    out = tmp_path / "storage.json"
    # A real disk (the bench refuses tmpfs): the repo's cache, a folder the bench removes.
    work = ROOT / ".cache" / "test-bench-storage"
    try:
        assert load_bench("storage").main(["--dir", str(work), "--gib", "0.03", "--workers", "2",
                             "--seconds", "0.2", "--rounds", "1", "--no-huge-pages",
                             "--json", str(out)]) == 0
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rec = json.loads(out.read_text())
    s = rec["summary"]
    loops = {r["buffers"]: r for r in rec["rows"] if "C read loop alone" in r["row"]}
    assert sorted(loops) == [2, 8]          # --workers and 4 x --workers buffers
    assert all(r["ios"] > 0 and r["gbytes_per_s"] > 0 for r in loops.values())
    for k in ("read_vs_fio_ratio", "c_loop_2_buffers_vs_fio_ratio",
              "c_loop_8_buffers_vs_fio_ratio", "fio_read_gbytes_per_s"):
        assert s[k] > 0, k
    assert rec["store_stats"]["misses"] == 0 and rec["store_stats"]["corrupt_blocks"] == 0
    assert "C read loop alone over 2 buffers" in capsys.readouterr().out
