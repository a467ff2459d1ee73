"""A TCP connection of an engine to itself (dp_tcp_conn_connect_self): a post copies into
the engine's own regions on the posting thread, no socket, with the checks a target makes
on a WRITE — and completions, failures and flushes as over a socket (dp.h)."""

from __future__ import annotations

import asyncio
import os

import pytest

from dualpath.errors import RdmaError, TransferError
from dualpath.tcp import Access, Item, QpState, TcpEngine, WcStatus
from dualpath.transfer import TransferConfig, TransferEngine
from dualpath.transfer.oob import InProcessChannel
from dualpath.transfer.tcp_provider import TcpProvider
from tests.integration.test_tcp_provider import drain

SIZE = 1 << 20


class Self:
    """Engine E writes from `src` into its own `dst` over a connection to itself."""

    def __init__(self):
        self.e = TcpEngine("127.0.0.1", 0)
        self.src, self.dst = bytearray(os.urandom(SIZE)), bytearray(SIZE)
        self.src_mr, self.dst_mr = self.e.register(self.src), self.e.register(self.dst)
        self.cq = self.e.cq(1024)
        self.conn = self.e.connection(self.cq)
        self.conn.connect_self()

    def item(self, src_off, dst_off, length, wr_id=0, **over):
        return Item(self.src_mr.addr + src_off, self.dst_mr.addr + dst_off, length,
                    self.src_mr.lkey, self.dst_mr.rkey, wr_id)._replace(**over)

    def drain(self, n_items):
        return drain(self.cq, n_items)


@pytest.fixture
def me():
    s = Self()
    yield s
    s.e.close()


def test_a_batch_lands_with_every_nth_signalled(me):
    items = [me.item(i * 4096, SIZE - (i + 1) * 4096, 4096, wr_id=7 + i) for i in range(16)]
    assert me.conn.post_write(items, signal_every=4) == 16
    comps = me.drain(16)
    assert [(c.wr_id, c.retired, c.status) for c in comps] == \
        [(10, 4, 0), (14, 4, 0), (18, 4, 0), (22, 4, 0)]
    for i in range(16):
        assert me.dst[SIZE - (i + 1) * 4096:SIZE - i * 4096] == me.src[i * 4096:(i + 1) * 4096]
    assert me.conn.outstanding == 0 and me.conn.state == QpState.RTS


def test_a_bad_key_fails_that_write_lands_none_after_and_flushes_the_rest(me):
    items = [me.item(0, 0, 100, wr_id=1), me.item(100, 100, 100, wr_id=2),
             me.item(200, 200, 100, wr_id=3, rkey=me.dst_mr.rkey ^ 0x10000),
             me.item(300, 300, 100, wr_id=4), me.item(400, 400, 100, wr_id=5)]
    assert me.conn.post_write(items, signal_every=8) == 5
    comps = me.drain(5)
    # The failed one retires the two before it (they landed); the rest are flushed.
    assert [(c.wr_id, c.retired, c.status) for c in comps] == \
        [(3, 3, WcStatus.REM_ACCESS_ERR), (5, 2, WcStatus.WR_FLUSH_ERR)]
    assert me.dst[:200] == me.src[:200] and me.dst[200:500] == bytes(300)
    assert me.conn.state == QpState.ERR
    # Reset and connect to itself again: usable.
    me.conn.reset()
    me.conn.connect_self()
    assert me.conn.post_write([me.item(200, 200, 300, wr_id=9)]) == 1
    assert [(c.wr_id, c.status) for c in me.drain(1)] == [(9, 0)]
    assert me.dst[:500] == me.src[:500]


def test_past_the_end_bad_lkey_and_no_remote_write_are_refused(me):
    ro = bytearray(4096)
    ro_mr = me.e.register(ro, Access.LOCAL_WRITE)            # no remote write
    cases = [(me.item(0, SIZE - 64, 128), WcStatus.REM_ACCESS_ERR),
             (me.item(0, 0, 64, lkey=me.src_mr.lkey ^ 0x10000), WcStatus.LOC_PROT_ERR),
             (Item(me.src_mr.addr, ro_mr.addr, 64, me.src_mr.lkey, ro_mr.rkey, 0),
              WcStatus.REM_ACCESS_ERR)]
    for item, status in cases:
        assert me.conn.post_write([item]) == 1
        assert [c.status for c in me.drain(1)] == [status]
        me.conn.reset()
        me.conn.connect_self()
    assert me.dst[SIZE - 64:] == bytes(64) and me.dst[:64] == bytes(64) and ro == bytes(4096)


def test_it_reaches_no_other_engine(me):
    # Another engine in the same process: its keys mean nothing to this one's copies.
    other = TcpEngine("127.0.0.1", 0)
    try:
        victim = bytearray(4096)
        mr = other.register(victim)
        assert me.conn.post_write([Item(me.src_mr.addr, mr.addr, 4096, me.src_mr.lkey,
                                        mr.rkey, 1)]) == 1
        assert [c.status for c in me.drain(1)] == [WcStatus.REM_ACCESS_ERR]
        assert victim == bytes(4096)
    finally:
        other.close()


def test_connect_self_needs_reset(me):
    with pytest.raises(RdmaError) as ei:
        me.conn.connect_self()
    assert "its own engine" in str(ei.value)


def test_the_transfer_engine_writes_to_itself_by_copy_and_recovers_after_a_rekey():
    async def main():
        provider = TcpProvider()
        eng = TransferEngine("me", provider, InProcessChannel(),
                             TransferConfig(slice_bytes=65536, timeout_s=10.0))
        await eng.start()
        try:
            src, dst = bytearray(os.urandom(SIZE)), bytearray(SIZE)
            eng.register("src", src)
            eng.register("dst", dst)
            await eng.write("me", [(0, 4096, 65536), (65536, 0, 4096)], local="src",
                            remote="dst")
            assert dst[4096:4096 + 65536] == src[:65536] and dst[:4096] == src[65536:69632]
            # A fence: the old key dies; our cached copy of it fails one write, and the
            # recovery takes the new keys from the engine itself.
            eng.rekey("dst")
            with pytest.raises(TransferError) as ei:
                await eng.write("me", [(0, 0, 64)], local="src", remote="dst")
            assert ei.value.status == WcStatus.REM_ACCESS_ERR
            await eng.write("me", [(128, 128, 256)], local="src", remote="dst")
            assert dst[128:384] == src[128:384]
            assert eng.stats["recoveries"] >= 1
            # Copies, not the loopback stack: no connection came in, nothing landed
            # through the engine's server.
            st = provider.engine.stats()
            assert st.conns_accepted == 0 and st.writes == 0 and st.bytes == 0
        finally:
            await eng.close()
    asyncio.run(main())
