"""TransferEngine over the verbs provider on real devices (the SoftRoCE guest): engine
"a" on rxe0 writes into engine "b" on rxe1 across the veth (or on rxe0 itself, loopback),
both on one event loop joined by the in-process out-of-band channel.

Covers issue 3 items 3 and 5 on verbs: a sliced batch spread over several QPs with its
bytes verified; a bad rkey and an out-of-range remote address each failing their own
transfer with REM_ACCESS_ERR, the QP reset and reconnected with its peer and the next
transfer succeeding; WRs flushed behind a failed one retried, not failed; and bounded
ends (never a hang) when the peer's QP went to RESET, when the peer closed, and when it
never answers.
"""

from __future__ import annotations

import asyncio
import errno
import os
import sys

import pytest

from dualpath import verbs
from dualpath.errors import TransferError, TransferTimeout
from dualpath.transfer import (
    ConnectReply,
    InProcessChannel,
    RegionInfo,
    TransferConfig,
    TransferEngine,
)
from dualpath.transfer.verbs_provider import VerbsProvider, encode_endpoint
from dualpath.verbs import QpState, WcStatus

SIZE = 4 << 20
# Outer bound against hangs only, never a performance assertion: rxe under TCG moves
# ~15-80 MB/s and a QP's retry exhaustion (timeout 14: 67 ms x 8 tries) takes ~0.5 s.
BOUND_S = 90.0


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, BOUND_S))


@pytest.fixture(params=["veth", "loopback"])
def devices(request, dev_names):
    """(a's device, b's device): rxe0 -> rxe1 over the veth, or rxe0 -> rxe0."""
    if request.param == "veth":
        if len(dev_names) < 2:
            pytest.skip("a second RDMA device is needed (DUALPATH_RDMA_DEV_B)")
        return dev_names[0], dev_names[1]
    return dev_names[0], dev_names[0]


@pytest.fixture
def veth(dev_names):
    if len(dev_names) < 2:
        pytest.skip("a second RDMA device is needed (DUALPATH_RDMA_DEV_B)")
    return dev_names[0], dev_names[1]


async def started_pair(devs, scoped: bool = False, **cfg):
    oob = InProcessChannel()
    config = TransferConfig(**{"slice_bytes": 65536, "timeout_s": 30.0, **cfg})
    a = TransferEngine("a", VerbsProvider(devs[0], cq_depth=config.cq_depth), oob, config)
    b = TransferEngine("b", VerbsProvider(devs[1], cq_depth=config.cq_depth), oob, config)
    await a.start()
    await b.start()
    src, dst = bytearray(os.urandom(SIZE)), bytearray(SIZE)
    a.register("default", src)
    b.register("default", dst, scoped=scoped)
    return a, b, src, dst


def qp_states(engine: TransferEngine, peer: str) -> list[QpState]:
    return [c.conn.qp.state for c in engine._peers[peer].conns]


def test_sliced_batch_spread_over_qps_lands(devices):
    async def main():
        a, b, src, dst = await started_pair(devices, connections_per_peer=3)
        try:
            assert a.transport == "verbs" and "verbs" in a.provider.description
            # Small items, one odd-sized, and a 1 MiB item cut into 16 slices of 64 KiB.
            items = [(0, 0, 4096), (8192, 65536, 100), (16384, 131072, 5000),
                     (1 << 20, 1 << 21, 1 << 20)]
            await a.write("b", items)
            for lo, ro, n in items:
                assert dst[ro:ro + n] == src[lo:lo + n]
            assert a.stats["writes_posted"] == 3 + 16       # plan_slices: 64 KiB slices
            await a.write("b", [(0, 0, SIZE)])              # 64 slices
            assert dst == src
            conns = a._peers["b"].conns
            # The 4 MiB batch (spread_min_bytes) is shared among the idle QPs by
            # plan.spread: all three carried some.
            assert len(conns) == 3 and all(c.posted > 0 for c in conns)
            assert sum(c.posted for c in conns) == 3 + 16 + 64
            assert len({c.conn.conn_id for c in conns}) == 3
            assert a.stats["error_completions"] == 0 and a.stats["recoveries"] == 0
        finally:
            await a.close()
            await b.close()
    run(main())


def test_few_credits_still_complete_large_batches(veth):
    async def main():
        # 2 QPs x 4 credits, CQ depth 3 with every 2nd WR signalled: the engine must
        # keep polling and posting the rest (dp_qp_post_write's -EAGAIN partial result).
        a, b, src, dst = await started_pair(veth, max_send_wr=4, cq_depth=3,
                                            signal_every=2, slice_bytes=4096)
        try:
            await a.write("b", [(0, 0, 256 << 10)])         # 64 slices of 4 KiB
            assert dst[:256 << 10] == src[:256 << 10]
            assert a.stats["writes_posted"] == 64
            assert a.stats["posts"] >= 64 // 8              # never more than 8 at once
        finally:
            await a.close()
            await b.close()
    run(main())


@pytest.mark.parametrize("tamper", ["stale_rkey", "past_the_end"])
def test_remote_access_error_fails_its_write_then_the_qp_recovers(devices, tamper):
    async def main():
        # One QP, so the write after the error must go through the recovered one.
        a, b, src, dst = await started_pair(devices, connections_per_peer=1)
        try:
            await a.write("b", [(0, 0, 4096)])
            peer = a._peers["b"]
            true = peer.regions["default"]
            # Our cached copy of b's region made wrong, as after b re-registered (new
            # rkey) or shrank its buffer: b's NIC (rxe's responder) must refuse it.
            if tamper == "stale_rkey":
                peer.regions = {"default": RegionInfo(true.addr, true.length,
                                                      true.rkey ^ 0x5A5A00)}
                item = (0, 4096, 4096)
            else:
                peer.regions = {"default": RegionInfo(true.addr, true.length + 8192,
                                                      true.rkey)}
                item = (0, true.length - 4096, 8192)    # 4 KiB inside, 4 KiB past the end
            with pytest.raises(TransferError) as ei:
                await a.write("b", [item])
            assert not isinstance(ei.value, TransferTimeout)
            assert ei.value.status == WcStatus.REM_ACCESS_ERR
            assert "REM_ACCESS_ERR" in str(ei.value)
            # The responder checks the whole range before writing a byte (rxe check_rkey).
            assert dst[item[1]:true.length] == bytes(true.length - item[1])
            assert a.stats["error_completions"] == 1 and a.stats["recoveries"] == 1

            # The QP was reset and reconnected with b's half (also reset: an access
            # error moves the responder's QP to ERR too); the exchange refreshed b's keys.
            await a.write("b", [(4096, 8192, 65536)])
            assert dst[8192:8192 + 65536] == src[4096:4096 + 65536]
            assert a._peers["b"].regions["default"] == true
            assert qp_states(a, "b") == [QpState.RTS]
            assert all(qp.state == QpState.RTS for qp in b.provider._passive.values())
            assert a.stats["error_completions"] == 1 and a.stats["recoveries"] == 1
        finally:
            await a.close()
            await b.close()
    run(main())


def test_writes_flushed_behind_a_failed_one_are_retried_not_failed(veth):
    async def main():
        a, b, src, dst = await started_pair(veth, connections_per_peer=1, slice_bytes=4096)
        other = bytearray(65536)
        b.register("other", other)
        try:
            await a.write("b", [(0, 0, 4096)])
            peer = a._peers["b"]
            o = peer.regions["other"]
            peer.regions = {**peer.regions,
                            "other": RegionInfo(o.addr, o.length, o.rkey ^ 0x5A5A00)}
            # One QP: the bad WRITE is posted first and the good write's 64 slices behind
            # it in the same chain; its failure flushes them (WR_FLUSH_ERR). They must go
            # back to the queue and land after the recovery, not fail. Both submissions
            # happen in one turn of the loop; a long GIL switch interval keeps the
            # data-path thread from waking between them, so they form one chain.
            old = sys.getswitchinterval()
            sys.setswitchinterval(30.0)
            try:
                bad, good = await asyncio.gather(
                    a.write("b", [(0, 0, 4096)], remote="other"),
                    a.write("b", [(0, 0, 256 << 10)]), return_exceptions=True)
            finally:
                sys.setswitchinterval(old)
            assert isinstance(bad, TransferError) and bad.status == WcStatus.REM_ACCESS_ERR
            assert good is None
            assert dst[:256 << 10] == src[:256 << 10]
            assert other == bytes(65536)
            # All 64 slices behind the bad one were flushed and re-posted after the
            # reconnect: 1 (first write) + 65 (one chain) + 64 (retries).
            assert a.stats["retried_slices"] == 64
            assert a.stats["writes_posted"] == 1 + 65 + 64
            assert qp_states(a, "b") == [QpState.RTS]
        finally:
            await a.close()
            await b.close()
    run(main())


def test_peer_qp_reset_ends_in_retry_error_then_recovers(veth):
    async def main():
        a, b, src, dst = await started_pair(veth, connections_per_peer=1)
        try:
            await a.write("b", [(0, 0, 4096)])
            # b's half goes back to RESET (as after a crash of its owner): rxe drops our
            # packets, our QP exhausts its retries (RETRY_EXC_ERR, ~0.5 s), the engine
            # resets it and redoes the exchange, which reconnects b's half; the write's
            # slices are retried (max_retries) and land.
            for qp in b.provider._passive.values():
                qp.reset()
            await a.write("b", [(0, 65536, 65536)])
            assert dst[65536:131072] == src[:65536]
            assert a.stats["error_completions"] >= 1 and a.stats["recoveries"] >= 1
            assert a.stats["retried_slices"] >= 1
            assert qp_states(a, "b") == [QpState.RTS]
        finally:
            await a.close()
            await b.close()
    run(main())


def test_peer_that_closed_fails_fast_with_an_error(veth):
    async def main():
        a, b, _src, _dst = await started_pair(veth, timeout_s=60.0)
        try:
            await a.write("b", [(0, 0, 4096)])
            await b.close()     # its QPs are destroyed and it leaves the channel
            with pytest.raises(TransferError) as ei:
                await a.write("b", [(0, 0, 65536)])
            # Not the 60 s timeout: the QPs' retries run out (an error completion), the
            # reconnect is refused (b is gone from the channel) and the write fails.
            assert not isinstance(ei.value, TransferTimeout)
            assert ei.value.errno == errno.ECONNREFUSED
            assert "unreachable" in str(ei.value)
            assert a.stats["error_completions"] >= 1
        finally:
            await a.close()
    run(main())


def test_peer_that_never_answers_is_bounded(veth):
    async def main():
        oob = InProcessChannel()
        config = TransferConfig(timeout_s=0.3, connections_per_peer=1, max_retries=0)
        a = TransferEngine("a", VerbsProvider(veth[0]), oob, config)
        # A "peer" whose QPs stay in RESET: its NIC silently drops every packet.
        hole = VerbsProvider(veth[1])
        target = bytearray(1 << 20)
        mr = hole.register(target)
        qps = []

        async def answer(req):
            qps.extend(hole.pd.qp(hole.cq, config=verbs.QpConfig(max_send_wr=1,
                                                                 **hole._qp_args))
                       for _ in req.endpoints)
            return ConnectReply("verbs", tuple(encode_endpoint(qp.endpoint())
                                               for qp in qps[-len(req.endpoints):]),
                                {"default": RegionInfo(mr.addr, mr.length, mr.rkey)})
        oob.serve("hole", answer)
        await a.start()
        try:
            a.register("default", bytearray(os.urandom(1 << 20)))
            with pytest.raises(TransferError) as ei:
                await a.write("hole", [(0, 0, 1 << 20)])
            # Either the 0.3 s bound passed first (TransferTimeout, ETIMEDOUT), or the
            # QP's retries ran out first (RETRY_EXC_ERR, not retried: max_retries 0).
            if isinstance(ei.value, TransferTimeout):
                assert ei.value.errno == errno.ETIMEDOUT and "hole" in str(ei.value)
            else:
                assert ei.value.status == WcStatus.RETRY_EXC_ERR, ei.value
            assert target == bytes(1 << 20)
        finally:
            await a.close()     # must not hang on the stuck QP
            hole.close()
    run(main())


def test_a_scoped_region_takes_a_peers_writes_only_inside_its_grants(devices):
    """Issue 38 item 3 on verbs: "b" registers its buffer scoped; "a" and "c" each hold
    a grant of their own 64 KiB. a's engine refuses, before posting, a WRITE outside
    the windows b granted it (EPERM: posted, it would break a's connections); and the
    NIC (rxe's responder: the QP's PD against the rkey's) takes a's WRITE inside a's
    window only: with c's key into c's window, with the region's whole key, into its own
    window once the grant ended, it is refused (REM_ACCESS_ERR) and no byte lands. On
    the code before per-peer PDs every one of them landed."""
    W = 65536

    async def main():
        oob = InProcessChannel()
        config = TransferConfig(slice_bytes=W, timeout_s=30.0, connections_per_peer=1)
        engines = [TransferEngine(n, VerbsProvider(d, cq_depth=config.cq_depth), oob, config)
                   for n, d in (("a", devices[0]), ("b", devices[1]), ("c", devices[0]))]
        a, b, c = engines
        for e in engines:
            await e.start()
        src = bytearray(os.urandom(SIZE))
        dst = bytearray(SIZE)
        a.register("default", src)
        c.register("default", src)
        b.register("default", dst, scoped=True)
        try:
            ga = b.grant("a", "default", [(0, W // 2), (W // 2, W // 2)])   # merged: 1 MR
            gc = b.grant("c", "default", [(W, W)])
            await a.write("b", [(0, 0, W)])                 # inside a's window
            assert dst[:W] == src[:W]
            await c.write("b", [(0, W, W)])                 # inside c's window
            assert dst[W:2 * W] == src[:W]

            errors = a.stats["error_completions"]
            for item in ((W, W, 4096),                      # c's window
                         (0, 4 * W, 4096),                  # nobody's
                         (0, W - 4096, 8192)):              # half a's, half c's
                before = bytes(dst)
                with pytest.raises(TransferError) as ei:    # refused before posting
                    await a.write("b", [item])
                assert ei.value.errno == errno.EPERM and "outside the windows" in str(ei.value)
                assert dst == before
            assert a.stats["error_completions"] == errors   # no connection broken
            info = a._peers["b"].regions["default"]
            assert info.scoped and [w[:2] for w in info.windows] == [(0, W)]
            assert b.scoped("default")
            # A writer that lies about its windows, even with c's own key for c's window
            # or the region's whole key elsewhere: b's NIC refuses both (a's QPs live in
            # a PD of their own, where neither key is).
            c_key = b.provider.view("c", b._regions["default"]).windows[0][2]
            peer = a._peers["b"]
            peer.regions = {"default": RegionInfo(
                info.addr, info.length, info.rkey,
                (info.windows[0], (W, W, c_key), (2 * W, W, info.rkey)), True)}
            for item in ((W, W, 4096), (0, 2 * W, 4096)):
                before = bytes(dst)
                with pytest.raises(TransferError) as ei:
                    await a.write("b", [item])
                assert ei.value.status == WcStatus.REM_ACCESS_ERR, ei.value
                assert dst == before
            peer.regions = {"default": info}    # (its recovery refreshes them too)

            # The grant ends: a's cached key for its window is dead on b's NIC.
            await a.rescope("b")
            ga.close()
            ga.close()                                      # idempotent
            with pytest.raises(TransferError) as ei:
                await a.write("b", [(4096, 0, 4096)])
            assert ei.value.status == WcStatus.REM_ACCESS_ERR
            assert dst[:W] == src[:W]
            # The same slots granted again: new keys, fetched by rescope, and it lands.
            ga = b.grant("a", "default", [(0, W)])
            await a.rescope("b")
            await a.write("b", [(4096, 0, 4096)])
            assert dst[:4096] == src[4096:8192]
            gc.close()
            ga.close()
            assert b.provider._grants == 0
        finally:
            for e in reversed(engines):
                await e.close()
    run(main())


def test_a_trusted_peer_writes_anywhere_in_a_scoped_region(veth):
    """The node's own worker (trusted: the node's identity) writes where the node hands
    it slots, with no grant: its QPs share our PD."""
    async def main():
        a, b, src, dst = await started_pair(veth, scoped=True, connections_per_peer=1)
        b.trust("a")
        try:
            await a.write("b", [(0, 0, SIZE)])
            assert dst == src
            assert not a._peers["b"].regions["default"].scoped
        finally:
            await a.close()
            await b.close()
    run(main())
