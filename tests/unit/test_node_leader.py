"""The leader's side of the reliability protocol (docs/reliability.md), against a fake
scheduler stub that records calls and a fake path/results that record what the leader
does to the node: claims on re-registration, exactly the refused ids dropped, a result
sent only once the scheduler recorded it (GetResults for one it ignored), FAILED with
its error and suspect, a graceful stop that delivers, quiesces, then releases, and the
channel made anew after repeated UNAVAILABLE."""

from __future__ import annotations

import asyncio
import types

import grpc

from dualpath import tls
from dualpath.metrics import new_registry
from dualpath.node.leader import RECONNECT_AFTER, Leader
from dualpath.paths.metrics import NodeMetrics
from dualpath.paths.ranks import EngineRank
from dualpath.v1 import scheduler_pb2 as pb

DONE, FAILED = pb.COMPLETION_STAGE_DECODE_DONE, pb.COMPLETION_STAGE_FAILED


class Unavailable(grpc.aio.AioRpcError):
    def __init__(self, code=grpc.StatusCode.UNAVAILABLE):
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "down")


class Scheduler:
    """Answers set by the test; every call recorded as (method, request)."""

    def __init__(self):
        self.calls: list[tuple[str, object]] = []
        self.cancelled: list[str] = []
        self.ignored: list[str] = []
        self.results: dict[str, pb.RequestResult] = {}
        self.fail: list[Exception] = []

    async def _call(self, name, req):
        self.calls.append((name, req))
        if self.fail:
            raise self.fail.pop(0)

    async def RegisterGroup(self, req, timeout):
        await self._call("RegisterGroup", req)
        return pb.RegisterGroupResponse(lease_id=7, cancelled_request_ids=self.cancelled)

    async def Fetch(self, req, timeout):
        await self._call("Fetch", req)
        return pb.FetchResponse(ignored_request_ids=self.ignored)

    async def ReportCompletion(self, req, timeout):
        await self._call("ReportCompletion", req)
        return pb.ReportCompletionResponse(ignored_request_ids=self.ignored)

    async def GetResults(self, req, timeout):
        await self._call("GetResults", req)
        return pb.GetResultsResponse(results=[
            self.results.get(r, pb.RequestResult(request_id=r,
                                                 state=pb.REQUEST_STATE_QUEUED))
            for r in req.request_ids])

    async def ReleaseGroup(self, req, timeout):
        await self._call("ReleaseGroup", req)
        return pb.ReleaseGroupResponse()


class Node:
    """The path, the node's cancel and the DE's results, recording."""

    def __init__(self, engine: EngineRank):
        self.e = engine
        self.running: list[tuple[str, bool]] = []
        self.events: list[str] = []

    def claims(self):
        return [(rid, self.e, done) for rid, done in self.running]

    def assign(self, e, a):
        self.events.append(f"assign {a.request_id}/{a.attempt}")

    def cancel(self, rid):
        self.events.append(f"cancel {rid}")

    def send_result(self, rid, attempt):
        self.events.append(f"send {rid}/{attempt}")

    def drop_result(self, rid):
        self.events.append(f"drop {rid}")


def leader(node: Node, sched: Scheduler) -> Leader:
    ld = Leader(node_id="d0", role="decode", address="d0:1", scheduler="127.0.0.1:1",
                tls_config=tls.PLAINTEXT, ranks=[node.e], path=node, cancel=node.cancel,
                read_q_tokens=lambda: 0, metrics=NodeMetrics(new_registry(), "decode"),
                profile_name="", block_bytes=1, storage_read_bytes_per_s=0,
                results=node)
    ld.scheduler = sched
    return ld


def engine() -> EngineRank:
    return EngineRank("d0/e0", 0, "hbm0", types.SimpleNamespace(capacity=4))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_reregistration_claims_and_drops_exactly_the_refused():
    async def main():
        e, sched = engine(), Scheduler()
        node = Node(e)
        ld = leader(node, sched)
        ld.attempts = {"r1": 3, "r2": 1}
        node.running = [("r1", True), ("r2", False)]
        ld.completions = [pb.Completion(request_id="r9", engine_id=e.engine_id, stage=DONE,
                                        attempt=2),
                          pb.Completion(request_id="r8", engine_id=e.engine_id,
                                        stage=FAILED, attempt=1)]
        sched.cancelled = ["r2", "r9"]
        await ld._register()
        reg = sched.calls[0][1]
        claims = {(c.request_id, c.attempt, c.prefill_done) for c in reg.running}
        # What runs, and the finished-unreported DECODE_DONE (as decoding).
        assert claims == {("r1", 3, True), ("r2", 1, False), ("r9", 2, True)}
        assert "cancel r2" in node.events and "cancel r9" in node.events
        assert "cancel r1" not in node.events
        # r9's DECODE_DONE was refused: asked about, not sent; r8's FAILED was not
        # claimed: dropped with its result.
        assert [c.request_id for c in ld.completions] == []
        assert [c.request_id for c in ld.unconfirmed] == ["r9"]
        assert "drop r8" in node.events
        assert ld.lease_id == 7 and ld.attempts == {"r1": 3}
    run(main())


def test_a_result_goes_out_only_once_recorded():
    async def main():
        e, sched = engine(), Scheduler()
        node = Node(e)
        ld = leader(node, sched)
        ld.lease_id = 7
        ld.attempts = {"a": 1, "b": 2, "c": 4}
        for rid in "abc":
            ld.complete(rid, e, DONE)
        sched.ignored = ["b", "c"]      # b: stale; c: recorded by a delivery whose answer was lost
        sched.results["c"] = pb.RequestResult(request_id="c", attempt=4,
                                               state=pb.REQUEST_STATE_DECODE_DONE)
        await ld._fetch_once()
        assert [n for n, _ in sched.calls] == ["Fetch", "GetResults"]
        assert list(sched.calls[1][1].request_ids) == ["b", "c"]
        assert node.events == ["send a/1", "drop b", "send c/4"]
    run(main())


def test_failed_completions_say_why_and_whom():
    async def main():
        e, sched = engine(), Scheduler()
        ld = leader(Node(e), sched)
        ld.attempts["r"] = 5
        ld.complete("r", e, FAILED, error="push of layer 3 to de:1: timed out" + "x" * 2000,
                    suspect="d1/e0")
        c = ld.completions[0]
        assert (c.attempt, c.suspect_engine_id) == (5, "d1/e0")
        assert c.error.startswith("push of layer 3") and len(c.error.encode()) <= 512
    run(main())


def test_graceful_stop_delivers_then_quiesces_then_releases():
    async def main():
        e, sched = engine(), Scheduler()
        node = Node(e)
        ld = leader(node, sched)
        ld.lease_id = 7
        ld.complete("a", e, DONE)

        async def quiesce():
            node.events.append("quiesce")
        await ld.shutdown(quiesce)
        assert [n for n, _ in sched.calls] == ["ReportCompletion", "ReleaseGroup"]
        assert node.events == ["send a/0", "quiesce"]
        assert sched.calls[1][1].lease_id == 7 and ld.lease_id == 0
        # Without a lease: no reports, no release, only the quiesce.
        sched.calls.clear()
        await ld.shutdown(quiesce)
        assert sched.calls == []
    run(main())


def test_no_lease_no_reports_and_the_channel_made_anew():
    async def main():
        e, sched = engine(), Scheduler()
        ld = leader(Node(e), sched)
        made = []
        ld._connect = lambda: made.append(1)          # a fresh channel and stub
        sched.fail = [Unavailable() for _ in range(RECONNECT_AFTER)]
        ld.complete("a", e, DONE)      # finished while the scheduler was away: claimed
        stop = asyncio.Event()
        task = asyncio.ensure_future(ld.run(stop))
        while len(sched.calls) <= RECONNECT_AFTER:
            await asyncio.sleep(0.01)
        stop.set()
        await task
        names = [n for n, _ in sched.calls]
        # Nothing but registrations until one succeeded (claiming "a"); then the kept
        # completion rides on a fetch. After RECONNECT_AFTER failures in a row the channel
        # was made anew.
        assert names[:RECONNECT_AFTER + 1] == ["RegisterGroup"] * (RECONNECT_AFTER + 1)
        assert made == [1]
        assert [c.request_id for c in sched.calls[RECONNECT_AFTER][1].running] == ["a"]
        assert sched.calls[names.index("Fetch")][1].completions[0].request_id == "a"
    run(main())


def test_a_lost_lease_registers_again_without_dropping_work():
    async def main():
        e, sched = engine(), Scheduler()
        node = Node(e)
        ld = leader(node, sched)
        node.running = [("r1", False)]
        ld.attempts = {"r1": 2}
        ld.lease_id = 3
        sched.fail = [Unavailable(grpc.StatusCode.FAILED_PRECONDITION)]
        stop = asyncio.Event()
        task = asyncio.ensure_future(ld.run(stop))
        while [n for n, _ in sched.calls].count("Fetch") < 2:
            await asyncio.sleep(0.01)
        stop.set()
        await task
        names = [n for n, _ in sched.calls]
        assert names[:3] == ["Fetch", "RegisterGroup", "Fetch"]
        assert [c.request_id for c in sched.calls[1][1].running] == ["r1"]
        assert node.events == []             # nothing dropped: the claim was kept
    run(main())
