"""A prefill that fails part way must not hand its HBM slots back while writes of earlier
layers still read from them: the next request would get those slots and the old writes
would carry its bytes into another request's DE buffer. The path is built from its
seams (NodeResources, a KV space, an engine, the PE's forward) with small fakes that
record the order of events; the failure is injected at layer 1's compute.

And a scheduler cancel landing while a failed prefill tells its DE must not skip the
release of its PE-buffer slots: they leaked, and the pool emptied for good (issue 36:
freezing the prefill node past its lease a few times stalled the cluster)."""

import asyncio
import dataclasses
import types

import numpy as np
import pytest

from dualpath.buffers.pool import BlockPool
from dualpath.engines.emulated.batching import ProfileEstimate
from dualpath.engines.emulated.engine import EmulatedEngine
from dualpath.engines.emulated.forward import PrefillForward
from dualpath.engines.emulated.prefill import EmulatedPrefillPath
from dualpath.kv.layout import BlockLayout
from dualpath.kv.placement import KvFormat
from dualpath.kv.profiles import get_profile
from dualpath.paths.assignment import Assignment
from dualpath.paths.errors import NotYours
from dualpath.paths.kvspace import KvSpace
from dualpath.paths.payload import Payload
from dualpath.paths.peers import Prepared
from dualpath.paths.ranks import EngineRank
from dualpath.paths.resources import NodeResources
from dualpath.roles import ReadSide
from dualpath.tls import Identity
from dualpath.trace.model import trajectory_token_ids

LAYOUT = BlockLayout(layers=4, tokens=8, token_bytes=16)


class RecordingPool(BlockPool):
    def __init__(self, events, *a, **kw):
        super().__init__(*a, **kw)
        self.events = events

    def _free(self, slots):
        self.events.append("hbm released")
        super()._free(slots)


class SlowTransfer:
    """Layer pushes that take a few loop turns (as a real WRITE takes its time)."""

    def __init__(self, events):
        self.events = events
        self.n = 0

    async def rescope(self, peer):
        pass

    async def write(self, peer, items, *, local, remote):
        n, self.n = self.n, self.n + 1
        for _ in range(5):
            await asyncio.sleep(0)
        self.events.append(f"push {n} done")


class FailingEngine(EmulatedEngine):
    def write_layer_kv(self, res, slots, spans, layer, first, stop):
        if layer == 1:
            raise RuntimeError("injected failure at layer 1")


def _prefill_path(events, peers_cancel):
    mem = np.zeros(1 << 16, np.uint8)
    hbm = RecordingPool(events, "hbm0", mem, LAYOUT.one_layer())
    de_pool = BlockPool("de_buffer", np.zeros(1 << 16, np.uint8), LAYOUT)
    de_space = KvSpace.for_store(None, None, de_pool, "de_buffer")
    pe_space = KvSpace.for_store(None, types.SimpleNamespace(
        expect=lambda *a: None, forget=lambda *a: None),
        BlockPool("pe_buffer", np.zeros(1 << 16, np.uint8), LAYOUT), "pe_buffer")

    class Peers:
        async def prepare(self, de, job):
            return Prepared(de_space.buffer, (0,))

        async def prefill_done(self, de, r):
            events.append("prefill done")

        cancel = staticmethod(peers_cancel)

        def expect(self, peer, identity):
            events.append(f"expect {identity or '-'} at {peer}")

    node = NodeResources("p0", "prefill", "pe:1", types.SimpleNamespace(
        engine=types.SimpleNamespace(layerwise=True)), SlowTransfer(events), Peers(),
        None, None, trajectory_token_ids, asyncio.ensure_future, lambda *a, **kw: None,
        None)
    profile = get_profile("demo")
    engine = FailingEngine(profile, 1.0)
    e = EngineRank("p0/e0", 0, "hbm0", hbm)
    forward = PrefillForward(profile, KvFormat.flat(LAYOUT), [e], ProfileEstimate(profile))
    payload = Payload("t0", 0, prompt_tokens=8, hit_tokens=0, gen_tokens=1)
    a = Assignment("r1", "p0/e0", "d0/e0", ReadSide.NONE, 8, 0, 1, 0, 0, "de:1", payload,
                   payload.encode())
    return EmulatedPrefillPath(node, pe_space, engine, forward), e, a, forward


def test_failed_prefill_waits_for_in_flight_pushes_before_releasing_hbm():
    events: list[str] = []

    async def main():
        async def cancel(de, rid, attempt):
            events.append("DE told")
            return True
        path, e, a, forward = _prefill_path(events, cancel)
        with pytest.raises(RuntimeError, match="injected"):
            await path.prefill(e, a, path.plan(a))
        await forward.close()

    asyncio.run(main())
    # Layer 0's push was in flight when layer 1 failed; it must end before its HBM goes
    # back and before the DE is told the attempt is over, and a failed prefill never
    # reports done.
    assert events == ["push 0 done", "hbm released", "DE told"], events


def test_a_cancel_while_the_de_is_told_still_releases_the_pe_buffer():
    events: list[str] = []

    async def main():
        telling, answer = asyncio.Event(), asyncio.Event()

        async def cancel(de, rid, attempt):      # the DE answers slowly (bounded: 2 s)
            telling.set()
            await answer.wait()
            events.append("DE told")
            return True
        path, e, a, forward = _prefill_path(events, cancel)
        pool = path.space.pool
        t = asyncio.ensure_future(path.prefill(e, a, path.plan(a)))
        await asyncio.wait_for(telling.wait(), 30)
        assert pool.free < pool.capacity         # its slots are still taken
        t.cancel()                               # the scheduler's cancel lands now
        await asyncio.sleep(0)
        answer.set()
        with pytest.raises(asyncio.CancelledError):
            await t
        await forward.close()
        return pool.free, pool.capacity

    free, capacity = asyncio.run(main())
    assert free == capacity, f"{capacity - free} PE-buffer slots leaked"
    assert events[-1] == "DE told"


def test_only_the_decode_node_assigned_may_stop_a_prefill():
    # The audit's attack (issue 38): a decode node stopped a prefill node's work on a
    # request that was not its own (Engine.CancelRequest); the request then sat in
    # "prefilling" for minutes. The assignment names its DE's identity; no other may.
    async def main():
        async def cancel(de, rid, attempt):
            return True
        path, e, a, forward = _prefill_path([], cancel)
        a = dataclasses.replace(a, attempt=1, decode_identity="node/d0")
        running = asyncio.Event()

        async def hang(e_, a_, plan):
            running.set()
            await asyncio.Event().wait()
        path.prefill = hang
        e.slots = asyncio.Semaphore(1)            # (the node sets it when it opens)
        path.assign(e, a)
        await asyncio.wait_for(running.wait(), 10)
        with pytest.raises(NotYours, match=r"\(attempt 1\) is decoded by node/d0; node/d1 may "
                                           "not stop"):
            await path.stop("r1", 1, Identity("node", "d1"))
        assert path.held_requests() == 1          # still running
        assert await path.stop("r1", 1, Identity("node", "d0")) is True
        assert path.held_requests() == 0 and ("r1", 1) not in path.decoders
        await forward.close()

    asyncio.run(main())
