"""TransferEngine over the real TCP provider on loopback, two engines on one event loop
joined by the in-process out-of-band channel: bytes, slicing, spreading, credits,
error completions with recovery, bounded timeouts, transport choice, and closing.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import re
import socket
import threading
import time

import pytest

from dualpath import metrics
from dualpath.config_sections import TransportConfig
from dualpath.errors import RdmaError, TransferError, TransferTimeout, UsageError
from dualpath.paths.metrics import OwnedCounters
from dualpath.transfer import (
    ConnectReply,
    InProcessChannel,
    RegionInfo,
    TransferConfig,
    TransferEngine,
    select_transport,
    selected_transport,
)
from dualpath.transfer.tcp_provider import TcpProvider, encode_address
from dualpath.verbs import WcStatus, list_devices

SIZE = 4 << 20
BOUND_S = 20.0      # outer bound against hangs; never a performance assertion


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, BOUND_S))


def engines(oob, **cfg):
    config = TransferConfig(**{"slice_bytes": 65536, "timeout_s": 10.0, **cfg})
    return (TransferEngine("a", TcpProvider(), oob, config),
            TransferEngine("b", TcpProvider(), oob, config))


@contextlib.asynccontextmanager
async def pair(**cfg):
    """Started engines a and b, a's `src` and b's `dst` registered as "default"."""
    oob = InProcessChannel()
    a, b = engines(oob, **cfg)
    await a.start()
    await b.start()
    try:
        src, dst = bytearray(os.urandom(SIZE)), bytearray(SIZE)
        a.register("default", src)
        b.register("default", dst)
        yield a, b, src, dst
    finally:
        await a.close()
        await b.close()


def test_single_batch_and_sliced_writes_land():
    async def main():
        async with pair() as (a, _b, src, dst):
            await a.write("b", [(0, 0, 4096)])
            assert dst[:4096] == src[:4096]
            await a.write("b", [(8192, 65536, 100), (16384, 131072, 5000), (1 << 20, 1 << 21, 7)])
            assert dst[65536:65636] == src[8192:8292]
            assert dst[131072:136072] == src[16384:21384]
            assert dst[1 << 21:(1 << 21) + 7] == src[1 << 20:(1 << 20) + 7]
            before = a.stats["writes_posted"]
            await a.write("b", [(0, 0, SIZE)])      # one item, 64 slices of 64 KiB
            assert a.stats["writes_posted"] - before == SIZE // 65536
            assert dst == src
    run(main())


def test_a_large_batch_is_spread_over_the_connections():
    async def main():
        async with pair(connections_per_peer=3, spread_min_bytes=3 << 20) as (a, _b, src, dst):
            await a.write("b", [(i * 65536, i * 65536, 65536) for i in range(48)])
            assert dst[:48 * 65536] == src[:48 * 65536]
            # 3 MiB, at spread_min_bytes: plan.spread shares 48 slices over 3 idle
            # connections, 16 each.
            assert [c.posted for c in a._peers["b"].conns] == [16, 16, 16]
    run(main())


def test_a_small_batch_goes_whole_to_one_connection_in_one_post():
    async def main():
        async with pair(connections_per_peer=2, spread_min_bytes=3 << 20) as (a, _b, src, dst):
            items = [(i * 65536, i * 65536, 65536) for i in range(47)]     # 3 MiB - 64 KiB
            await a.write("b", items)
            conns = a._peers["b"].conns
            assert sorted(c.posted for c in conns) == [0, 47]
            assert a.stats["posts"] == 1
            # Idle again: the next batch takes the other connection (the rotation breaks
            # the tie), so batches in a row still use every connection.
            dst[:] = bytes(SIZE)
            await a.write("b", [(lo + 65536, ro + 65536, n) for lo, ro, n in items])
            assert [c.posted for c in conns] == [47, 47] and a.stats["posts"] == 2
            assert dst[65536:48 * 65536] == src[65536:48 * 65536]
    run(main())


def test_few_credits_still_complete_large_batches():
    async def main():
        async with pair(max_send_wr=4, cq_depth=3, signal_every=2,
                                            slice_bytes=4096) as (a, _b, src, dst):
            await a.write("b", [(0, 0, 1 << 20)])  # 256 slices through 2 x 4 credits
            assert dst[:1 << 20] == src[:1 << 20]
            assert a.stats["posts"] >= 256 // 8
    run(main())


def test_concurrent_writes_all_land():
    async def main():
        async with pair() as (a, _b, src, dst):
            chunk = SIZE // 64
            await asyncio.gather(*(a.write("b", [(i * chunk, SIZE - (i + 1) * chunk, chunk)])
                                   for i in range(64)))
            for i in range(64):
                assert dst[SIZE - (i + 1) * chunk:SIZE - i * chunk] == src[i * chunk:(i + 1) * chunk]
    run(main())


@pytest.mark.parametrize("tamper", ["stale_rkey", "past_the_end"])
def test_remote_access_error_fails_the_write_and_the_peer_recovers(tamper):
    async def main():
        async with pair() as (a, _b, src, dst):
            await a.write("b", [(0, 0, 4096)])
            peer = a._peers["b"]
            true = peer.regions["default"]
            # Make our cached copy of b's region wrong, as a peer that re-registered (new
            # rkey) or shrank its buffer would: the TARGET must refuse the write.
            if tamper == "stale_rkey":
                peer.regions = {"default": RegionInfo(true.addr, true.length, true.rkey ^ 0x10000)}
                item = (0, 4096, 4096)
            else:
                peer.regions = {"default": RegionInfo(true.addr, true.length + 8192, true.rkey)}
                item = (0, true.length - 4096, 8192)    # 4 KiB inside, 4 KiB past the end
            with pytest.raises(TransferError) as ei:
                await a.write("b", [item])
            assert ei.value.status == WcStatus.REM_ACCESS_ERR
            assert "REM_ACCESS_ERR" in str(ei.value)
            assert not isinstance(ei.value, TransferTimeout)
            assert dst[item[1]:true.length] == bytes(true.length - item[1])
            # Both connections to b were reset (the other one held the same stale keys:
            # a write posted on it before the exchange would fail the same way), and
            # reconnected; the exchange refreshed b's keys.
            assert a.stats["recoveries"] == 2
            await a.write("b", [(4096, 8192, 65536)])
            assert dst[8192:8192 + 65536] == src[4096:4096 + 65536]
            assert a._peers["b"].regions["default"] == true
            assert a.stats["recoveries"] >= 1
            # What a node's /metrics says of it (paths/metrics.OwnedCounters).
            reg = metrics.new_registry(process=False)
            reg.register(OwnedCounters(a.stats, dict))
            text = metrics.render(reg)
            for name in ("error_completions", "recoveries"):
                got = re.search(rf"^dualpath_node_transfer_{name}_total (\S+)$", text, re.MULTILINE)
                assert float(got[1]) == a.stats[name] >= 1
    run(main())


def test_a_failed_write_does_not_fail_the_writes_flushed_behind_it():
    async def main():
        async with pair(connections_per_peer=1, slice_bytes=4096) as (a, b, src, dst):
            other = bytearray(65536)
            b.register("other", other)
            await a.write("b", [(0, 0, 4096)])
            peer = a._peers["b"]
            o = peer.regions["other"]
            peer.regions = {**peer.regions, "other": RegionInfo(o.addr, o.length, o.rkey ^ 0x10000)}
            # On one connection, the bad WRITE goes first and the good write's slices
            # behind it are flushed by its failure: they must be retried, not failed.
            bad, good = await asyncio.gather(
                a.write("b", [(0, 0, 4096)], remote="other"),
                a.write("b", [(0, 0, 1 << 20)]), return_exceptions=True)
            assert isinstance(bad, TransferError) and bad.status == WcStatus.REM_ACCESS_ERR
            assert good is None
            assert dst[:1 << 20] == src[:1 << 20]
            assert other == bytes(65536)
    run(main())


@contextlib.asynccontextmanager
async def to_a_hole(timeout_s: float):
    """Engine a, started, writing to "hole": a peer that accepts TCP connections in the
    kernel but never reads or acks."""
    oob = InProcessChannel()
    a = TransferEngine("a", TcpProvider(), oob,
                       TransferConfig(timeout_s=timeout_s, connections_per_peer=1))
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(8)

    async def answer(req):
        return ConnectReply("tcp", tuple(encode_address(*hole.getsockname())
                                         for _ in req.endpoints),
                            {"default": RegionInfo(0x1000, 1 << 30, 1)})
    oob.serve("hole", answer)
    await a.start()
    try:
        a.register("default", bytearray(1 << 20))
        yield a
    finally:
        await a.close()     # must not hang on the stuck connection
        hole.close()


def test_timeout_when_the_peer_stops_reading():
    async def main():
        async with to_a_hole(0.3) as a:
            with pytest.raises(TransferTimeout) as ei:
                await a.write("hole", [(0, 0, 1 << 20)])
            assert ei.value.errno == errno.ETIMEDOUT
            assert "hole" in str(ei.value)
    run(main())


def test_a_cancelled_write_is_cancelled_and_its_bound_never_fires():
    async def main():
        loop = asyncio.get_running_loop()
        errors = []
        loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
        async with to_a_hole(0.3) as a:
            task = asyncio.ensure_future(a.write("hole", [(0, 0, 1 << 20)]))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.5)        # past the bound: its timer went with it
        assert errors == []
    run(main())


def slow_to_stop(a: TransferEngine, delay_s: float) -> None:
    """The data-path thread takes ``delay_s`` to stop a given-up write (as under load)."""
    cancel = a._dp._cancel

    def slow(t):
        time.sleep(delay_s)
        cancel(t)
    a._dp._cancel = slow


@pytest.mark.parametrize("how", ["cancelled", "past its bound"])
def test_a_given_up_write_returns_only_once_its_connection_was_reset(how):
    """A writer that gives a write up (cancelled: its request was dropped; or past its
    bound) may then tell the peer its writes ended and let the memory go: that holds only
    if nothing of the write is still queued or on the wire then (the fence's premise,
    paths/fence.py). The write returns once the data-path thread reset the connection
    carrying it, however long that takes; before, it returned at once, and a cancelled
    writer's only safe course was to wait out the write's bound (transfer.timeout_s: a
    peer cut off held a prefill that long)."""
    async def main():
        async with to_a_hole(0.3 if how == "past its bound" else 30.0) as a:
            slow_to_stop(a, 0.3)
            task = asyncio.ensure_future(a.write("hole", [(0, 0, 1 << 20)]))
            await asyncio.sleep(0.1)
            if how == "cancelled":
                task.cancel()
            with pytest.raises(asyncio.CancelledError if how == "cancelled"
                               else TransferTimeout):
                await task
            assert a.stats["recoveries"] == 1     # reset before the writer heard
    run(main())


def test_a_closed_peer_fails_fast_with_an_error():
    async def main():
        async with pair(timeout_s=15.0) as (a, b, _src, _dst):
            await a.write("b", [(0, 0, 4096)])
            await b.close()
            with pytest.raises(TransferError) as ei:
                await a.write("b", [(0, 0, 65536)])
            # Not a timeout: the dead sockets give error completions, reconnecting is
            # refused (b left the channel), and the write fails naming why.
            assert not isinstance(ei.value, TransferTimeout)
            assert ei.value.errno == errno.ECONNREFUSED
            assert "unreachable" in str(ei.value)
    run(main())


def test_unknown_peer_and_bad_items_are_clear_errors():
    async def main():
        async with pair() as (a, _b, _src, _dst):
            with pytest.raises(TransferError) as ei:
                await a.write("nobody", [(0, 0, 1)])
            assert ei.value.errno == errno.ECONNREFUSED and "nobody" in str(ei.value)
            with pytest.raises(UsageError, match=r"items\[1\]: remote range"):
                await a.write("b", [(0, 0, 1), (0, SIZE - 1, 2)])
            with pytest.raises(UsageError, match="no local region named 'kv'"):
                await a.write("b", [(0, 0, 1)], local="kv")
            with pytest.raises(UsageError, match="has no region named 'kv'"):
                await a.write("b", [(0, 0, 1)], remote="kv")
            with pytest.raises(UsageError, match="already registered"):
                a.register("default", bytearray(8))
    run(main())


def test_close_is_idempotent_and_fails_later_writes():
    async def main():
        async with pair() as (a, _b, _src, _dst):
            await a.write("b", [(0, 0, 4096)])
            await a.close()
            await a.close()
            with pytest.raises(UsageError, match="closing|closed"):
                await a.write("b", [(0, 0, 1)])
    run(main())


def test_engines_need_the_same_transport():
    async def main():
        oob = InProcessChannel()

        async def verbs_peer(req):
            return ConnectReply("verbs", tuple(b"" for _ in req.endpoints), {})
        oob.serve("v", verbs_peer)
        async with TransferEngine("a", TcpProvider(), oob) as a:
            a.register("default", bytearray(64))
            with pytest.raises(TransferError) as ei:
                await a.write("v", [(0, 0, 1)])
            assert ei.value.errno == errno.EPROTONOSUPPORT
    run(main())


def test_auto_picks_tcp_here_and_says_why(caplog):
    if list_devices():
        pytest.skip(f"this host has RDMA devices {list_devices()}: auto would pick verbs")
    caplog.set_level(logging.INFO, logger="dualpath.transfer")

    async def main():
        oob = InProcessChannel()
        eng = TransferEngine.open("x", oob, transport=TransportConfig(kind="auto"))
        async with eng:
            assert eng.transport == "tcp"
    run(main())
    assert selected_transport() == "tcp"
    text = caplog.text
    assert "transport: tcp (auto chose tcp: no RDMA device" in text
    assert "transfer engine x: transport tcp" in text


def test_verbs_required_without_a_device_fails_clearly():
    if list_devices():
        pytest.skip(f"this host has RDMA devices {list_devices()}")
    with pytest.raises(RdmaError) as ei:
        select_transport(TransportConfig(kind="verbs"))
    assert ei.value.errno == errno.ENODEV
    msg = str(ei.value)
    assert "transport.kind = 'verbs' but no RDMA device is usable" in msg
    assert "transport.kind = 'tcp'" in msg      # says what to do instead


def test_connections_are_made_and_reset_on_the_data_path_thread():
    """dp.h: a connection is made, reset or closed only on the thread that posts and
    polls its CQ (then posting takes no lock): the engine's data-path thread, for a
    first connect and for a recovery's reset of a half-made connect alike."""
    async def main():
        async with pair(connections_per_peer=2) as (a, _b, _src, _dst):
            threads = []
            make = a.provider.connection

            def connection(max_send_wr):
                threads.append(("make", threading.current_thread()))
                conn = make(max_send_wr)
                reset = conn.reset

                def recorded_reset():
                    threads.append(("reset", threading.current_thread()))
                    reset()
                conn.reset = recorded_reset
                return conn
            a.provider.connection = connection
            await a.connect("b")
            c = a._peers["b"].conns[0]
            # a recovery whose first exchange fails resets the half-made connect
            fails = {"n": 1}
            request = a.oob.request

            async def flaky(peer, req, expect=""):
                if fails["n"]:
                    fails["n"] -= 1
                    raise TransferError("exchange lost", errno=errno.ECONNRESET)
                return await request(peer, req, expect)
            a.oob.request = flaky
            await a._recover(c)
            dp = a._dp._thread
            assert [k for k, _ in threads].count("make") == 2
            assert "reset" in [k for k, _ in threads]
            assert all(t is dp for _, t in threads), threads
    run(main())
