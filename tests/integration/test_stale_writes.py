"""A stale attempt's writes never land in memory that serves another attempt.

A real DE node daemon (in process: emulated engine, TCP data plane, plaintext) and a PE
played by the test: its own TransferEngine writing over the real data plane, its own
Engine service whose CancelRequest answers only when the test says the old attempt's
writes ended. The request is prepared for attempt 1, then for attempt 2 (the scheduler
gave attempt 1 up, e.g. its PE stalled past its lease):

- attempt 1's DE-buffer slots are fenced, not reused: attempt 2 gets other slots, and so
  does anyone reserving the whole rest of the pool;
- attempt 1's writer, still writing, lands its bytes in the fenced slots only: not one
  of them appears in attempt 2's memory;
- every message of attempt 1 is refused (ABORTED): PrepareRequest, SubmitTransferOrder,
  WatchTransfers, PrefillDone;
- once the writer answers that its writes ended, the fenced slots go back to the pool.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from dualpath import tls
from dualpath.errors import DualPathError
from dualpath.kv.placement import KvPlacement, runs
from dualpath.node.daemon import NodeDaemon
from dualpath.node.servicers import new_server
from dualpath.paths.payload import Payload
from dualpath.paths.peers import LoadOrder, PeerClient, PrefillReport, PrepareJob
from dualpath.transfer import TransferEngine
from dualpath.transfer.oob_grpc import GrpcChannels, GrpcOutOfBand
from dualpath.v1 import engine_pb2, engine_pb2_grpc
from tests.integration.de_node import decode_node

BOUND_S = 60.0          # an outer bound against hangs, never a timing assertion
STALE = 0xBB
PROMPT = 128            # two 64-token blocks of the demo profile


class WriterEngine(engine_pb2_grpc.EngineServicer):
    """The PE's Engine service: CancelRequest answers once ``stopped`` is set."""

    def __init__(self):
        self.stopped = asyncio.Event()
        self.asked = 0

    async def CancelRequest(self, request, context):
        self.asked += 1
        await self.stopped.wait()
        return engine_pb2.CancelRequestResponse()


async def _aborted(call) -> str:
    with pytest.raises(DualPathError) as e:
        await call
    assert "ABORTED" in str(e.value), e.value
    return str(e.value)


def test_a_stale_attempts_writes_never_reach_the_new_attempts_memory(tmp_path):
    async def main():
        async with decode_node(tmp_path) as (de, cfg):
            channels = GrpcChannels(tls.PLAINTEXT)
            server, port, _ = new_server("127.0.0.1:0")
            writer = WriterEngine()
            engine_pb2_grpc.add_EngineServicer_to_server(writer, server)
            await server.start()
            pe_addr = f"127.0.0.1:{port}"
            pe = TransferEngine.open(pe_addr, GrpcOutOfBand(channels),
                                     transport=cfg.transport, transfer=cfg.transfer)
            await pe.start()
            try:
                await _run(de, pe, pe_addr, PeerClient(channels), writer)
            finally:
                await pe.close()
                await server.stop(0)
                await channels.close()

    asyncio.run(asyncio.wait_for(main(), BOUND_S))


async def _run(de: NodeDaemon, pe: TransferEngine, pe_addr: str, peers: PeerClient,
               writer: WriterEngine) -> None:
    rid, eng = "r1", "d0/e0"
    payload = Payload("t0", 0, PROMPT, 0, 1).encode()
    pool, fmt = de.engine.space.pool, de.engine.space.fmt
    src = np.full(4 * pool.stride, STALE, np.uint8)     # what the stale writer sends
    pe.register("src", src)
    src_place = KvPlacement.full_blocks(fmt, "src", pool.stride, 4)

    def job(attempt):
        return PrepareJob(rid, eng, pe_addr, PROMPT, 0, payload, attempt)

    old = await peers.prepare(de.address, job(1))
    new = await peers.prepare(de.address, job(2))        # the scheduler's next attempt
    assert not set(old.slots) & set(new.slots), "attempt 2 got attempt 1's fenced slots"
    assert de.fences.blocks == len(old.slots)

    # Nobody else gets them either while the old writer may still write.
    rest = pool.try_reserve(pool.free)
    assert rest is not None and not set(rest.slots) & set(old.slots)
    rest.release()

    # The stale writer, still running, writes every layer into the slots it was given.
    for layer in range(fmt.layers):
        for r in runs(src_place, src_place.units_of_slots(range(len(old.slots))),
                      old.buffer, old.buffer.units_of_slots(old.slots), layer, 0, PROMPT):
            await pe.write(de.address, [(r.src_offset, r.dst_offset, r.length)],
                           local=r.src_region, remote=r.dst_region)
    st = de.path.requests[rid]
    assert st.attempt == 2
    for i in range(len(new.slots)):
        assert not (st.buffer.flat(i) == STALE).any(), "a stale byte in attempt 2's memory"
    landed = sum(int((pool.memory[s * pool.stride:(s + 1) * pool.stride] == STALE).sum())
                 for s in old.slots)
    assert landed > 0      # the bytes went where they were aimed: fenced memory

    # Every message of the old attempt is refused.
    await _aborted(peers.prepare(de.address, job(1)))
    await _aborted(peers.order_load(de.address, LoadOrder(
        rid, [b"\0" * 16], pe_addr, src_place, [0], 1)))
    await _aborted(peers.prefill_done(de.address, PrefillReport(
        rid, "p0/e0", "p0", 0.0, 0, (0.0, 0.0), 1, 0)))
    watch = peers.watch(de.address, rid, 1)
    with pytest.raises(DualPathError, match="ABORTED"):
        await watch.ready(0)
    watch.close()
    assert rid in de.path.requests and de.path.requests[rid] is st   # attempt 2 intact

    # The fence asked the writer and waits for it; once it answers, the slots are back.
    while writer.asked == 0:
        await asyncio.sleep(0.05)
    assert de.fences.blocks == len(old.slots)
    free = pool.free
    writer.stopped.set()
    while de.fences.blocks:
        await asyncio.sleep(0.05)
    assert pool.free == free + len(old.slots)
    # The old attempt's cancel is answered (its writes ended long ago: nothing of it is
    # running), and attempt 2 is left intact. (It was refused ABORTED, which a PE took
    # as no answer: its fence asked again for 600 s with its slots held.)
    await engine_pb2_grpc.EngineStub(peers.channels.channel(de.address)).CancelRequest(
        engine_pb2.CancelRequestRequest(request_id=rid, attempt=1), timeout=10)
    assert de.path.requests[rid] is st
