"""vLLM P/D's pure parts: who reads which hit blocks, the staged hit (its ticket, its
blocks, its reference count), the connector's reading of kv_transfer_params."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from dualpath.engines.vllm.engine import VllmEngine
from dualpath.engines.vllm.prefill import VllmPrefillPath
from dualpath.engines.vllm.stage import Stage
from dualpath.paths.assignment import split_blocks
from dualpath.paths.layers import BothReady, LocalArrivals
from dualpath.roles import ReadSide
from dualpath.storage import BlockStore
from dualpath.vllm.scheduler_side import dualpath_params


@pytest.mark.parametrize("policy, side, pe, de, want", [
    ("prefill", ReadSide.DECODE, 0, 0, (10, 0)),
    ("decode", ReadSide.PREFILL, 0, 0, (0, 10)),
    ("split", ReadSide.PREFILL, 0, 0, (5, 5)),
    ("none", ReadSide.PREFILL, 0, 0, (0, 0)),
    ("scheduler", ReadSide.PREFILL, 1280, 0, (10, 0)),
    ("scheduler", ReadSide.DECODE, 0, 1280, (0, 10)),
    ("scheduler", ReadSide.SPLIT, 384, 896, (3, 7)),     # the scheduler's split, in blocks
])
def test_the_read_side_becomes_blocks_per_side(policy, side, pe, de, want):
    assert split_blocks(policy, side, 10, pe, de, 128) == want
    assert sum(split_blocks(policy, side, 0, pe, de, 128)) == 0


class _Store:
    """Blocks stored: the first ``n`` of a request's keys."""

    def __init__(self, keys, n):
        self.stored = set(keys[:n])

    index = upkeep = None               # no index, no capacity: a lookup per block

    def _file_exists(self, key):
        return key in self.stored

    contains = _file_exists
    leading = BlockStore.leading        # the store's own prefix walk over these blocks

    async def arun(self, fn, *args):
        return fn(*args)


@pytest.mark.parametrize("stored, want", [
    (10, (3, 7)),          # all stored: the scheduler's split as it came
    (5, (2, 3)),           # the tail in a DE's write-back: both parts shrink
    (1, (0, 1)),
    (0, (0, 0)),           # nothing stored: nothing read, all computed
])
def test_a_split_keeps_its_proportions_over_the_blocks_stored_now(stored, want):
    """The newest blocks of a hit (the DE's part, the tail) may still be in a decode
    node's write-back: the DE must not be planned to read them, or the prefill node reads
    all its share while the DE reads less (the busiest storage NIC, bench/vllm_pd.py)."""
    keys = [bytes([i]) * 16 for i in range(10)]
    path = SimpleNamespace(space=SimpleNamespace(store=_Store(keys, stored)))
    got = asyncio.run(VllmPrefillPath._split_stored(path, keys, 3, 7))
    assert got == want and sum(got) == min(stored, 10)


class _Res:
    def __init__(self, n):
        self.slots = tuple(range(100, 100 + n))
        self.released = 0

    def flat(self, i):
        return i

    def release(self):
        self.released += 1


async def _stage(keys, ticket="t" * 32):
    res = _Res(len(keys))

    async def n(v):
        return v
    return Stage("r1", ticket, keys, res, LocalArrivals(), n(len(keys)), n(len(keys)),
                 release=lambda r: r.release(), on_saved=lambda k, r: None), res


def test_a_stage_serves_only_its_own_blocks_and_goes_back_with_its_last_holder():
    async def go():
        keys = [bytes([i]) * 16 for i in range(4)]
        st, res = await _stage(keys)
        assert st.match(keys) == (0, 4)
        assert st.match(keys[2:]) == (2, 2)
        assert st.match([keys[0], b"x" * 16]) == (0, 1)
        assert st.match([b"y" * 16]) == (0, 0)
        v = st.view(1, 2)
        assert v.slots == (101, 102) and v.flat(0) == 1
        st.unref()                      # the owner lets go: a load still holds it
        assert res.released == 0
        v.release()
        v.release()                     # idempotent
        assert res.released == 1
    asyncio.run(go())


def test_only_the_requests_ticket_finds_its_stage():
    """An instance's HTTP client that names another request's id (to be served its
    staged KV, or to send its own blocks to that request's DE) is not given the stage."""
    async def go():
        st, _ = await _stage([b"k" * 16], ticket="a" * 32)
        eng = VllmEngine.__new__(VllmEngine)
        eng.stages, eng._bad_tickets, eng.node_id = {"r1": st}, 0, "n"
        assert eng.stage_for("r1", "a" * 32) is st
        assert eng.stage_for("r1", "b" * 32) is None
        assert eng.stage_for("r1", "") is None
        assert eng.stage_for("r2", "a" * 32) is None
        assert eng._bad_tickets == 1
    asyncio.run(go())


def test_both_ready_waits_for_every_source():
    async def go():
        a, b = LocalArrivals(), LocalArrivals()
        both = BothReady([a, b])
        a.landed(2)
        t = asyncio.ensure_future(both.ready(1))
        await asyncio.sleep(0)
        assert not t.done()
        b.landed(2)
        await asyncio.wait_for(t, 1)
    asyncio.run(go())


@pytest.mark.parametrize("params, want", [
    ({"dualpath": {"request_id": "r", "ticket": "t"}}, ("r", "t", False)),
    ({"dualpath": {"request_id": "r", "ticket": "t", "save_all": True}}, ("r", "t", True)),
    ({"dualpath": {"request_id": "r", "ticket": "t", "save_all": 1}}, ("r", "t", False)),
    (None, ("", "", False)),
    ({"dualpath": "r"}, ("", "", False)),
    ({"dualpath": {"request_id": 3, "ticket": "t"}}, ("", "", False)),
    ({"dualpath": {"request_id": "r" * 300, "ticket": "t"}}, ("", "", False)),
    ({"other": {}}, ("", "", False)),
])
def test_the_connector_reads_only_well_formed_dualpath_params(params, want):
    assert dualpath_params(SimpleNamespace(kv_transfer_params=params)) == want
