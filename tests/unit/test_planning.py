"""§4.2's bottleneck-free P/D range and §8.2's working set, against the paper's numbers."""

from __future__ import annotations

import math

import pytest

from dualpath.errors import UsageError
from dualpath.planning import Hardware, bottleneck_free_range, working_set_bytes

GB = 1e9


def paper_node(**over) -> Hardware:
    # g = 8, s = 1 (one 50 GB/s storage NIC per node, 50 GB/s per compute NIC), M = 500
    return Hardware(**{"gpus_per_node": 8, "cnic_bytes_per_s": 50 * GB,
                       "snic_bytes_per_s": 50 * GB, "mem_bytes_per_s": 500 * GB, **over})


def test_the_papers_example_is_one_seventh_to_seven_halves():
    r = bottleneck_free_range(paper_node())
    assert r.low == pytest.approx(1 / 7) and r.high == pytest.approx(7 / 2)
    # the appendix notes' per-constraint figures: (5) 6, (7) 3.5, (8) 3.5
    assert r.bounds["de_cnic_read"] == pytest.approx(6)
    assert r.bounds["de_cnic_write"] == pytest.approx(3.5)
    assert r.bounds["de_memory"] == pytest.approx(3.5)
    assert r.describe().startswith("bottleneck-free for 1/7 <= P/D <= 7/2")
    assert r.contains(2, 4) and r.contains(1, 7) and r.contains(7, 2)
    assert not r.contains(1, 8) and not r.contains(4, 1)


def test_more_storage_per_node_narrows_the_range_until_none_is_left():
    wide = bottleneck_free_range(paper_node())
    narrow = bottleneck_free_range(paper_node(snic_bytes_per_s=100 * GB))   # s = 2
    assert narrow.low > wide.low and narrow.high < wide.high
    # s = 2: DE NIC read (8-4)/2 = 2, write 6/4 = 1.5, memory (500/100 - 3)/2 = 1
    assert narrow.low == pytest.approx(2 / 6) and narrow.high == pytest.approx(1.0)
    none = bottleneck_free_range(paper_node(snic_bytes_per_s=250 * GB))     # s = 5 > g/2
    assert none.empty and not none.pe_reads_ok and "s > g/2" in none.describe()
    assert not none.contains(1, 1)


def test_slow_memory_caps_the_range():
    r = bottleneck_free_range(paper_node(mem_bytes_per_s=200 * GB))    # M/(Bs) = 4
    assert r.high == pytest.approx(0.5) and "de memory" in r.describe()


def test_working_set_is_half_the_live_contexts():
    # 0.45 agents/s, trajectories of 1,000 s, 64K tokens at the end: 14,745,600 tokens
    ws = working_set_bytes(0.45, 1000, 65536, 70272)
    assert ws == pytest.approx(0.45 * 1000 * 65536 / 2 * 70272)
    assert working_set_bytes(0, 1000, 65536, 1) == 0


@pytest.mark.parametrize("bad", [{"gpus_per_node": 0}, {"cnic_bytes_per_s": 0},
                                 {"mem_bytes_per_s": -1.0}])
def test_bad_hardware_is_refused_by_name(bad):
    with pytest.raises(UsageError, match=next(iter(bad))):
        paper_node(**bad)


def test_bad_working_set_inputs_are_refused():
    with pytest.raises(UsageError, match="trajectory_s"):
        working_set_bytes(0.1, -1, 10, 1)
    with pytest.raises(UsageError, match="agents_per_s"):
        working_set_bytes(math.nan, 1, 10, 1)
