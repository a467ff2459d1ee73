"""A LOAD_HIT_KV order whose first connect to the PE waits while the PE cancels the
request: the load must not start afterwards (it would WRITE a dropped request's hits into
PE memory that may already serve another request: the KV mismatch seen once in
test_node_stalled_past_its_lease under load)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from dualpath.engine.decode import DecodePath, DecodeState
from dualpath.engine.errors import StaleAttempt
from dualpath.engine.peers import LoadOrder
from dualpath.kv.layout import BlockLayout
from dualpath.kv.placement import KvFormat, KvPlacement

FMT = KvFormat.flat(BlockLayout(2, 4, 8))


class Slots:
    released = False

    def release(self):
        self.released = True


def _path(connect_gate: asyncio.Event, spawned: list):
    async def connect(peer):
        await connect_gate.wait()

    def spawn(coro):
        spawned.append(coro)
        return asyncio.ensure_future(coro)

    d = DecodePath.__new__(DecodePath)
    d.requests, d.assigned = {}, {}
    d.space = SimpleNamespace(fmt=FMT, read_queue=SimpleNamespace(forget=lambda rid: None))
    d.node = SimpleNamespace(transfer=SimpleNamespace(connect=connect), spawn=spawn,
                             fences=SimpleNamespace(settled=lambda *a: None))
    return d


def test_an_order_is_not_carried_out_for_a_request_dropped_while_connecting():
    async def main():
        gate, spawned = asyncio.Event(), []
        d = _path(gate, spawned)
        st = DecodeState("r1", engine=None, payload=None, spans=[None, None],
                         buffer=Slots(), pe_address="pe", attempt=1)
        d.requests["r1"] = st
        order = LoadOrder("r1", "pe/e0", "pe/e0", [bytes(16)], "pe",
                          KvPlacement.full_blocks(FMT, "hbm", 1024, 4), [0], 1, 0)
        accepting = asyncio.ensure_future(d.accept_order(order))
        await asyncio.sleep(0)                       # waiting for its first connect
        assert await d.stop("r1", 1, None)           # the PE cancels: its writes ended
        assert st.buffer.released
        gate.set()
        with pytest.raises(StaleAttempt, match="dropped here while connecting"):
            await accepting
        return spawned

    assert asyncio.run(main()) == []                 # no load was started
