"""DataPath._place, the data-path thread's choice of connections for the queued
segments, as a pure policy over fakes (no provider): order kept, nothing lost or
duplicated, credits respected, a small batch on one connection, a large one spread."""

from __future__ import annotations

from collections import Counter, deque
from itertools import pairwise
from types import SimpleNamespace

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from dualpath._native import ffi
from dualpath.transfer.config import TransferConfig
from dualpath.transfer.datapath import DataPath, Seg

SPREAD_MIN = 1000


def fake_conn(room: int, wrs: int) -> SimpleNamespace:
    return SimpleNamespace(wrs=wrs, conn=SimpleNamespace(max_send_wr=room + wrs))


def transfer(slices: int, nbytes: int) -> SimpleNamespace:
    return SimpleNamespace(nslices=slices, nbytes=nbytes, done=False)


def place(batches, rooms, loads):
    """Queue one segment per (slices, nbytes) batch; place them; (transfers, the
    connections' segment lists, what stayed queued)."""
    ts = [transfer(n, b) for n, b in batches]
    peer = SimpleNamespace(pending=deque(Seg(t, 0, t.nslices) for t in ts))
    ups = [fake_conn(r, w) for r, w in zip(rooms, loads)]
    engine = SimpleNamespace(config=TransferConfig(spread_min_bytes=SPREAD_MIN))
    out = DataPath._place(engine, peer, ups)
    return ts, out, list(peer.pending)


def sizes(out) -> list[int]:
    """The slices each connection was given."""
    return [sum(s.stop - s.start for s in segs) for segs in out]


batches = st.lists(st.tuples(st.integers(1, 40), st.sampled_from([10, 999, 1000, 5000])),
                   min_size=1, max_size=8)
conns = st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), min_size=1, max_size=4)


@given(batches, conns)
def test_placement_keeps_every_slice_once_in_order_within_credits(bs, cs):
    rooms, loads = [r for r, _ in cs], [w for _, w in cs]
    ts, out, left = place(bs, rooms, loads)
    assert all(n <= room for n, room in zip(sizes(out), rooms))
    for t in ts:
        mine = sorted((s.start, s.stop) for segs in [*out, left] for s in segs
                      if s.transfer is t)
        # the pieces of each transfer tile [0, nslices) exactly: none lost, none twice
        assert mine[0][0] == 0 and mine[-1][1] == t.nslices
        assert all(a[1] == b[0] for a, b in pairwise(mine))
    # the queue is taken from its head: what stayed is a suffix, in the original order
    order = [(id(s.transfer), s.start) for s in left]
    assert order == sorted(order, key=lambda k: ([id(t) for t in ts].index(k[0]), k[1]))
    if sum(rooms) >= sum(n for n, _ in bs):
        assert not left                 # room for everything: everything placed


@given(batches, conns)
def test_a_small_batch_is_on_one_connection_unless_credits_cut_it(bs, cs):
    rooms, loads = [r for r, _ in cs], [w for _, w in cs]
    ts, out, left = place(bs, rooms, loads)
    full = [n == room for n, room in zip(sizes(out), rooms)]
    for t in ts:
        if t.nbytes >= SPREAD_MIN:
            continue
        pieces = sorted((s.start, i) for i, segs in enumerate(out) for s in segs
                        if s.transfer is t)
        cut = pieces if any(s.transfer is t for s in left) else pieces[:-1]
        # a piece is followed by another only where its connection's credits ran out
        assert all(full[i] for _, i in cut)

def test_small_batches_go_to_the_least_loaded_connection():
    _, out, left = place([(8, 10)], rooms=[100, 100, 100], loads=[30, 5, 20])
    assert sizes(out) == [0, 8, 0] and not left
    # two batches: the second sees the first's load
    _, out, _ = place([(8, 10), (8, 10)], rooms=[100, 100], loads=[0, 4])
    assert sizes(out) == [8, 8]


def test_a_large_batch_is_spread_evenly():
    _, out, left = place([(48, 5000)], rooms=[256, 256, 256], loads=[0, 0, 0])
    assert sizes(out) == [16, 16, 16]
    assert not left


def test_no_credits_anywhere_leaves_the_queue_as_it_was():
    _, out, left = place([(4, 10), (4, 5000)], rooms=[0, 0], loads=[256, 256])
    assert out == [[], []] and [(s.start, s.stop) for s in left] == [(0, 4), (0, 4)]


def test_a_transfer_failed_earlier_in_the_round_is_not_posted():
    """_post skips the parts of a transfer already failed for good (say by the post on
    another connection this round): its caller was told it failed, so none of its
    writes may land after that."""
    rows = np.array([[0, 0, 4096], [4096, 4096, 4096]], dtype=np.uint64)
    live = SimpleNamespace(done=False, remote="r", end=8192, rows=rows, local_base=0,
                           lkey=1, ptr=ffi.cast("uint64_t *", ffi.from_buffer(rows)), kptr=None)
    failed = SimpleNamespace(**{**vars(live), "done": True})
    posted = []
    peer = SimpleNamespace(name="b", pending=deque(),
                           regions={"r": SimpleNamespace(addr=0, length=1 << 20, rkey=2)})
    conn = SimpleNamespace(peer=peer, posted=0, wrs=0, fifo=deque(), conn=SimpleNamespace(
        items=ffi.new("struct dp_item[]", 8),
        post=lambda n, _signal: posted.append(n) or n))
    engine = SimpleNamespace(config=TransferConfig(), stats=Counter(), _wr_seq=0,
                             _inflight=0)
    DataPath._post(engine, conn, [Seg(failed, 0, 2), Seg(live, 0, 2)])
    assert posted == [2] and [s.transfer for s in conn.fifo] == [live]
