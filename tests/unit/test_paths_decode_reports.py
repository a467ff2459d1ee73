"""A decode node's results go to their sink in one call per sink and loop turn, and a
sink takes at most REPORTS_PER_CALL timings per call."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from dualpath import tls
from dualpath.cluster import replay
from dualpath.paths.decode import DecodePath, _Result
from dualpath.paths.errors import PeerUnavailable
from dualpath.paths.peers import (
    REPORT_BYTES_PER_CALL,
    REPORTS_PER_CALL,
    Timings,
    report_bytes,
    report_calls,
)
from dualpath.scheduler import generate
from dualpath.v1 import node_pb2, node_pb2_grpc


class _Peers:
    def __init__(self, fail: bool = False):
        self.calls: list[tuple[str, list[str]]] = []
        self.fail = fail

    async def report(self, sink, timings, expect=""):
        self.calls.append((sink, [t.request_id for t in timings]))
        self.expects = getattr(self, "expects", []) + [(sink, expect)]
        if self.fail:
            raise PeerUnavailable(f"{sink}: UNAVAILABLE")


class _Node:
    def __init__(self, peers: _Peers):
        self.peers = peers

    def spawn(self, coro):
        return asyncio.ensure_future(coro)


def _path(peers: _Peers, results: dict[str, tuple[int, str]]) -> DecodePath:
    path = DecodePath(_Node(peers), None, {}, lambda path: None)
    for rid, (attempt, sink) in results.items():
        path.results[rid] = _Result(attempt, Timings(rid, "d0/e0", "p0", "d0",
                                                     attempt=attempt), sink)
    return path


def test_results_recorded_in_one_turn_go_in_one_call_per_sink():
    async def run():
        peers = _Peers()
        rids = {f"r{i}": (1, "sink-a:1" if i % 3 else "sink-b:1") for i in range(3000)}
        rids["stale"] = (2, "sink-a:1")
        path = _path(peers, rids)
        for rid in rids:
            path.send_result(rid, 1)        # "stale" holds attempt 2: dropped
        assert peers.calls == []            # nothing until the loop turns
        await path.flush(timeout_s=5)
        by_sink = {}
        for sink, ids in peers.calls:
            assert len(ids) <= REPORTS_PER_CALL
            by_sink.setdefault(sink, []).extend(ids)
        assert len(peers.calls) == 2 + 1    # a: 2000 in two calls, b: 1000 in one
        assert sorted(by_sink["sink-a:1"]) == sorted(r for r, (_, s) in rids.items()
                                                     if s == "sink-a:1" and r != "stale")
        assert len(by_sink["sink-b:1"]) == 1000
        assert path.results == {}           # the stale one dropped, unsent
        path.send_result("r1", 1)           # already sent: never twice
        await path.flush(timeout_s=5)
        assert len(peers.calls) == 3

    asyncio.run(run())


def test_reports_with_many_generated_tokens_go_in_calls_of_about_a_mebibyte():
    # A real engine's timings carry its tokens: 1,024 of 20K tokens each would be ~250
    # MB in one call, past gRPC's 4 MiB receive limit.
    big = [Timings(f"r{i}", "d0/e0", "p0", "d0", output_token_ids=tuple(range(20_000)))
           for i in range(10)]
    calls = list(report_calls(big))
    assert [t.request_id for c in calls for t in c] == [t.request_id for t in big]
    assert report_bytes(big[0]) == 256 + 16 * 20_000
    assert all(sum(map(report_bytes, c)) <= REPORT_BYTES_PER_CALL for c in calls)
    assert [len(c) for c in calls] == [3, 3, 3, 1]
    huge = Timings("h", "d0/e0", "p0", "d0", output_token_ids=tuple(range(100_000)))
    assert [len(c) for c in report_calls([huge, *big[:2]])] == [1, 2]    # alone


def test_an_unreachable_sink_is_logged_not_raised(caplog):
    async def run():
        path = _path(_Peers(fail=True), {"r1": (1, "gone:1"), "r2": (1, "gone:1")})
        path.send_result("r1", 1)
        path.send_result("r2", 1)
        await path.flush(timeout_s=5)
        assert not path.reports

    asyncio.run(run())
    assert "replay sink gone:1 unreachable for 2 results (r1, ...)" in caplog.text


@pytest.mark.parametrize("sink", ["replay", "generate"])
def test_a_sink_refuses_more_than_its_bound_and_takes_nothing_of_it(sink):
    async def run():
        if sink == "replay":
            servicer = replay._Sink(tls.PLAINTEXT)
            taken = lambda: servicer.queue.qsize()
        else:
            gen = generate.Generator("127.0.0.1:1", tls.PLAINTEXT, tls.PLAINTEXT)
            fut = asyncio.get_running_loop().create_future()
            gen._waiting["r0"] = fut
            servicer = generate._Sink(gen)
            taken = lambda: int(fut.done())
        server = grpc.aio.server()
        node_pb2_grpc.add_ReplaySinkServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = node_pb2_grpc.ReplaySinkStub(ch)
                many = [node_pb2.RequestTimings(request_id=f"r{i}")
                        for i in range(REPORTS_PER_CALL + 1)]
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Report(node_pb2.RequestTimingsBatch(timings=many), timeout=5)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert f"at most {REPORTS_PER_CALL}" in e.value.details()
                assert taken() == 0
                await stub.Report(node_pb2.RequestTimingsBatch(timings=many[:2]), timeout=5)
                assert taken() == (2 if sink == "replay" else 1)
        finally:
            await server.stop(None)

    asyncio.run(run())


def test_results_go_to_their_sink_as_their_submitter_only():
    # Issue 38: the decode node checks that the sink answering is the identity that
    # submitted the request (the scheduler's assignment says who); results of two
    # submitters that name one sink address go in a call each, each with its own.
    async def run():
        peers = _Peers()
        path = _path(peers, {})
        for rid, who in (("a", "client/fe"), ("b", "client/other"), ("c", "client/fe")):
            path.results[rid] = _Result(1, Timings(rid, "d0/e0", "p0", "d0", attempt=1),
                                        "sink:1", who)
            path.send_result(rid, 1)
        await asyncio.sleep(0.05)
        return peers
    peers = asyncio.run(run())
    assert sorted(peers.expects) == [("sink:1", "client/fe"), ("sink:1", "client/other")]
    assert sorted(peers.calls) == [("sink:1", ["a", "c"]), ("sink:1", ["b"])]
