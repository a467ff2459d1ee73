"""A burst past the queue bound during a 1P2D replay (the harness: conftest.py).

With ``scheduler.max_queued_requests`` small, another client submits a burst far past
it in one call: the excess is rejected (QUEUE_FULL) before anything is queued for it,
what was accepted runs to DECODE_DONE like everything else, and the replay — whose own
submissions may meet the full queue too and are retried (backpressure, counted in
submit_retries) — loses and duplicates nothing. No group's lease is touched.
"""

from __future__ import annotations

import time

import pytest

from dualpath import tls
from dualpath.paths.payload import Payload
from dualpath.v1 import scheduler_pb2, scheduler_pb2_grpc
from tests.faults.conftest import Fault, check, lapses, make_cluster, run_replay, scheduler_log

pytestmark = pytest.mark.slow

QUEUE_BOUND = 8
BURST = 40


def test_burst_past_the_queue_bound(tmp_path):
    c = make_cluster(tmp_path, scheduler={"max_queued_requests": QUEUE_BOUND})
    c.start()
    try:
        out: dict = {}

        def burst(cluster):
            specs = [scheduler_pb2.RequestSpec(
                request_id=f"burst-{i}", prompt_tokens=256, max_new_tokens=4,
                payload=Payload(f"burst-{i}", 0, 256, 0, 4).encode()) for i in range(BURST)]
            with tls.sync_channel(cluster.scheduler_address, cluster.client_tls) as ch:
                out["reply"] = scheduler_pb2_grpc.SchedulerStub(ch).SubmitRequest(
                    scheduler_pb2.SubmitRequestRequest(requests=specs), timeout=10)

        fault = Fault(after=3, action=burst)
        run = run_replay(c, fault)
        reply = out["reply"]
        accepted = list(reply.request_ids)
        assert len(accepted) + len(reply.rejected) == BURST
        assert reply.rejected and accepted, "the burst was all rejected or all accepted"
        assert {x.reason for x in reply.rejected} == {scheduler_pb2.REJECT_REASON_QUEUE_FULL}
        # Every accepted request of the burst ends DECODE_DONE (a liveness bound only).
        with tls.sync_channel(c.scheduler_address, c.client_tls) as ch:
            stub = scheduler_pb2_grpc.SchedulerStub(ch)
            deadline = time.monotonic() + 120
            while True:
                r = stub.GetResults(scheduler_pb2.GetResultsRequest(
                    request_ids=accepted, wait_ms=500), timeout=10)
                states = {x.state for x in r.results}
                if states <= {scheduler_pb2.REQUEST_STATE_DECODE_DONE}:
                    break
                assert time.monotonic() < deadline, f"burst requests stuck: {states}"
        assert all(lapses(scheduler_log(c), g) == 0 for g in ("p0", "d0", "d1"))
        fault.notes.update(burst=BURST, burst_accepted=len(accepted),
                           burst_rejected=len(reply.rejected),
                           replay_submit_retries=run.submit_retries)
        check("burst past the queue bound", c, run, fault, max_failed=0)
    finally:
        c.stop()
