"""The Generator's one GetResults poller, against a scheduler stand-in (the policy of
who is polled when; the real scheduler path runs in tests/vllm/test_pd.py).

- a request is polled only once the scheduler accepted it: one whose SubmitRequest is
  still in flight is never asked about (it would be UNKNOWN and failed wrongly);
- a request the scheduler ended FAILED raises GenerationFailed naming it;
- every call stays within RESULTS_PER_CALL ids and acknowledgements together;
- close() fails what still waits instead of leaving it to its deadline.
"""

from __future__ import annotations

import asyncio

import pytest

from dualpath import tls
from dualpath.node.leader import RESULTS_PER_CALL
from dualpath.node.servicers import new_server
from dualpath.scheduler.generate import GenerationFailed, Generator
from dualpath.v1 import scheduler_pb2, scheduler_pb2_grpc

BOUND_S = 30.0          # an outer bound against hangs, never a timing assertion


class FakeScheduler(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self):
        self.accepted: set[str] = set()
        self.states: dict[str, int] = {}
        self.slow = asyncio.Event()          # SubmitRequest of "slow" waits for it
        self.asked_early: list[str] = []     # ids asked about before they were accepted
        self.largest_call = 0

    async def SubmitRequest(self, request, context):
        for spec in request.requests:
            if spec.request_id == "slow":
                await self.slow.wait()
            self.accepted.add(spec.request_id)
            self.states[spec.request_id] = scheduler_pb2.REQUEST_STATE_QUEUED
        return scheduler_pb2.SubmitRequestResponse()

    async def GetResults(self, request, context):
        self.largest_call = max(self.largest_call, len(request.request_ids)
                                + len(request.acknowledged_request_ids))
        self.asked_early += [r for r in request.request_ids if r not in self.accepted]
        if request.wait_ms:
            await asyncio.sleep(0.02)
        return scheduler_pb2.GetResultsResponse(results=[
            scheduler_pb2.RequestResult(
                request_id=r, state=self.states.get(r, scheduler_pb2.REQUEST_STATE_UNKNOWN),
                error="engine on fire", failed_attempts=5)
            for r in request.request_ids])


def test_the_poller_asks_only_about_accepted_requests_and_close_ends_the_rest():
    async def main():
        fake = FakeScheduler()
        server, port, _ = new_server("127.0.0.1:0")
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(fake, server)
        await server.start()
        gen = await Generator(f"127.0.0.1:{port}", tls.PLAINTEXT, tls.PLAINTEXT).start()
        try:
            a = asyncio.ensure_future(gen.generate("a", [1, 2, 3], 2, timeout_s=BOUND_S))
            while "a" not in fake.accepted:
                await asyncio.sleep(0.01)
            slow = asyncio.ensure_future(gen.generate("slow", [1, 2], 1,
                                                      timeout_s=BOUND_S))
            await asyncio.sleep(0.5)        # the poller asks about "a" many times
            assert not slow.done() and not a.done()
            fake.states["a"] = scheduler_pb2.REQUEST_STATE_FAILED
            with pytest.raises(GenerationFailed, match="a failed after 5 attempt.*on fire"):
                await a
            fake.slow.set()                 # "slow" accepted now, and polled from here
            while "slow" not in fake.accepted:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            assert not slow.done()
            await gen.close()
            with pytest.raises(GenerationFailed, match="closed"):
                await slow
            assert fake.asked_early == []
            assert 0 < fake.largest_call <= RESULTS_PER_CALL
            with pytest.raises(GenerationFailed, match="closed"):
                await gen.generate("late", [1, 2], 1)
        finally:
            await gen.close()
            await server.stop(0)

    asyncio.run(asyncio.wait_for(main(), BOUND_S))
