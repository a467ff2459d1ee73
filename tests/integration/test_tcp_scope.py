"""The TCP target's scope (csrc/tcp_scope.c): in a scoped region an admitted peer WRITEs
only inside the windows granted to its tag; an ungrant stops it, a WRITE under way
included; the owner's trusted tag and its own copies are not scoped. The attack these
guard against: a node admitted on a decode node's data port writing into slots prepared
for another node's request (issue 38).
"""

from __future__ import annotations

import os

import pytest

from dualpath.errors import RdmaError
from dualpath.tcp import Item, TcpEngine, WcStatus
from tests.integration.test_tcp_provider import WAIT_BOUND_S, drain

SLOT = 64 << 10


class Scoped:
    """Engine B's 8 slots of SLOT bytes, scoped; engine A connects as peer tag ``tag``."""

    def __init__(self, tag=7, trusted=False, size=8 * SLOT):
        self.a = TcpEngine("127.0.0.1", 0)
        self.b = TcpEngine("127.0.0.1", 0)
        self.src = bytearray(os.urandom(size))
        self.dst = bytearray(size)
        self.src_mr = self.a.register(self.src)
        self.dst_mr = self.b.register(self.dst, scoped=True)
        self.cq = self.a.cq(1024)
        self.conn = self.a.connection(self.cq)
        self.tag, self.trusted = tag, trusted
        self.connect()

    def connect(self):
        self.conn.connect("127.0.0.1", self.b.port, timeout=WAIT_BOUND_S,
                          credential=self.b.admit(self.tag, trusted=self.trusted))

    def reconnect(self):
        self.conn.reset()
        self.connect()

    def write(self, dst_off, length, wr_id=1, src_off=0):
        it = Item(self.src_mr.addr + src_off, self.dst_mr.addr + dst_off, length,
                  self.src_mr.lkey, self.dst_mr.rkey, wr_id)
        assert self.conn.post_write([it]) == 1
        (wc,) = drain(self.cq, 1)
        return wc.status

    def close(self):
        self.a.close()
        self.b.close()


@pytest.fixture
def sc():
    s = Scoped()
    yield s
    s.close()


def test_a_write_lands_only_inside_its_peers_windows(sc):
    g = sc.b.grant(sc.tag, sc.dst_mr, [(2 * SLOT, SLOT), (3 * SLOT, SLOT)])
    assert sc.write(2 * SLOT, 2 * SLOT) == WcStatus.SUCCESS     # two touching windows: one
    assert sc.dst[2 * SLOT:4 * SLOT] == sc.src[:2 * SLOT]
    # Another request's slot (never granted to this peer): refused, nothing lands.
    sc.reconnect()
    assert sc.write(0, 4096, src_off=0) == WcStatus.REM_ACCESS_ERR
    sc.reconnect()
    assert sc.write(4 * SLOT - 4096, 8192) == WcStatus.REM_ACCESS_ERR   # runs past the end
    sc.reconnect()
    assert sc.write(5 * SLOT, 4096) == WcStatus.REM_ACCESS_ERR          # starts past it
    assert sc.dst[:2 * SLOT] == bytes(2 * SLOT) and sc.dst[4 * SLOT:] == bytes(4 * SLOT)
    st = sc.b.stats()
    assert st.out_of_scope == 3 and st.refused == 3
    assert sc.b.ungrant(g) and not sc.b.ungrant(g)


def test_another_peers_grant_does_not_admit_this_one(sc):
    sc.b.grant(sc.tag + 1, sc.dst_mr, [(0, 8 * SLOT)])      # another node's request
    assert sc.write(0, 4096) == WcStatus.REM_ACCESS_ERR
    assert sc.dst == bytes(len(sc.dst))


def test_nothing_lands_after_ungrant_returns():
    s = Scoped(size=32 << 20)
    try:
        g = s.b.grant(s.tag, s.dst_mr, [(0, len(s.dst))])
        assert s.write(0, 4096) == WcStatus.SUCCESS
        it = Item(s.src_mr.addr, s.dst_mr.addr, len(s.src), s.src_mr.lkey, s.dst_mr.rkey, 2)
        assert s.conn.post_write([it]) == 1
        early = s.cq.poll()
        assert s.b.ungrant(g)           # waits out any recvmsg into the window
        snapshot = bytes(s.dst)
        (wc,) = early or drain(s.cq, 1)
        assert wc.status in (WcStatus.SUCCESS, WcStatus.REM_ACCESS_ERR)
        assert bytes(s.dst) == snapshot
        s.reconnect()
        assert s.write(0, 4096, src_off=4096) == WcStatus.REM_ACCESS_ERR   # an old attempt
        assert bytes(s.dst) == snapshot
    finally:
        s.close()


def test_the_owners_trusted_tag_is_not_scoped():
    s = Scoped(trusted=True)
    try:
        assert s.write(5 * SLOT, SLOT) == WcStatus.SUCCESS
        assert s.dst[5 * SLOT:6 * SLOT] == s.src[:SLOT]
    finally:
        s.close()


def test_own_copies_are_not_scoped():
    e = TcpEngine()
    try:
        src, dst = bytearray(os.urandom(4096)), bytearray(4096)
        s_mr, d_mr = e.register(src), e.register(dst, scoped=True)
        conn = e.connection(e.cq(16))
        conn.connect_self()
        assert conn.post_write([Item(s_mr.addr, d_mr.addr, 4096, s_mr.lkey, d_mr.rkey, 3)])
        assert [c.status for c in drain(conn.cq, 1)] == [WcStatus.SUCCESS]
        assert dst == src
    finally:
        e.close()


def test_bad_grants_are_refused(sc):
    with pytest.raises(RdmaError, match="EINVAL"):
        sc.b.grant(sc.tag, sc.dst_mr, [(8 * SLOT - 1, 2)])          # outside the region
    with pytest.raises(RdmaError, match="EINVAL"):
        sc.b.grant(sc.tag, sc.dst_mr, [(0, 0)])                     # empty
    plain = sc.b.register(bytearray(4096))
    with pytest.raises(RdmaError, match="EINVAL"):
        sc.b.grant(sc.tag, plain, [(0, 4096)])                      # not scoped
    small = TcpEngine(max_grants=2)
    try:
        mr = small.register(bytearray(4096), scoped=True)
        small.grant(1, mr, [(0, 1)])
        small.grant(1, mr, [(1, 1)])
        with pytest.raises(RdmaError, match="ENOSPC"):
            small.grant(1, mr, [(2, 1)])
    finally:
        small.close()
