"""A DE's load into a PE's memory against the PE's cancel (Engine.CancelRequest, "your
writes for it ended?"):

- an order whose first connect to the PE waits while the PE cancels the request must not
  start afterwards (it would WRITE a dropped request's hits into PE memory that may
  already serve another request: the KV mismatch seen once in
  test_node_stalled_past_its_lease under load);
- a request the scheduler dropped here first (its state gone, its load still writing)
  is answered only once that load ended: "not known" is not "ended" (the wrong bytes
  of a partitioned prefill node, issue 36)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from dualpath.engines.emulated.decode import EmulatedDecoder
from dualpath.kv.layout import BlockLayout
from dualpath.kv.placement import KvFormat, KvPlacement
from dualpath.kv.prefix import ROOT_KEY
from dualpath.paths.decode import DecodePath, DecodeState
from dualpath.paths.errors import StaleAttempt
from dualpath.paths.kvplan import BlockSpan, DecodePlan
from dualpath.paths.peers import LoadOrder

FMT = KvFormat.flat(BlockLayout(2, 4, 8))


def _plan(blocks: int, held: int = 0) -> DecodePlan:
    T = FMT.block_tokens
    return DecodePlan("r1", 1, blocks * T, T,
                      tuple(BlockSpan(i, bytes(16), T) for i in range(blocks)), True, held)


class Slots:
    released = False
    slots = (0,)

    def release(self):
        self.released = True


def _path(connect_gate: asyncio.Event, spawned: list):
    async def connect(peer, expect=""):
        await connect_gate.wait()

    def spawn(coro):
        spawned.append(coro)
        return asyncio.ensure_future(coro)

    d = DecodePath.__new__(DecodePath)
    d.requests, d.assigned, d.ending, d.cancelled, d.submitters = {}, {}, {}, {}, {}
    d.space = SimpleNamespace(fmt=FMT, read_queue=SimpleNamespace(forget=lambda rid: None))
    d.node = SimpleNamespace(transfer=SimpleNamespace(connect=connect), spawn=spawn,
                             fences=SimpleNamespace(settled=lambda *a: None))
    return d


def test_an_order_is_not_carried_out_for_a_request_dropped_while_connecting():
    async def main():
        gate, spawned = asyncio.Event(), []
        d = _path(gate, spawned)
        st = DecodeState("r1", engine=None, payload=None, plan=_plan(2),
                         buffer=Slots(), pe_address="pe", attempt=1)
        d.requests["r1"] = st
        order = LoadOrder("r1", [bytes(16)], "pe",
                          KvPlacement.full_blocks(FMT, "hbm", 1024, 4), [0], 1, 0)
        accepting = asyncio.ensure_future(d.accept_order(order))
        await asyncio.sleep(0)                       # waiting for its first connect
        assert await d.stop("r1", 1, None)           # the PE cancels: its writes ended
        assert st.buffer.released
        gate.set()
        with pytest.raises(StaleAttempt, match="dropped here while connecting"):
            await accepting
        return spawned

    assert asyncio.run(main()) == []                 # no load was started


def test_a_cancel_waits_for_the_load_of_a_request_the_scheduler_dropped_first():
    async def main():
        writes_end = asyncio.Event()
        d = _path(asyncio.Event(), [])
        st = DecodeState("r1", engine=None, payload=None, plan=_plan(2),
                         buffer=Slots(), pe_address="pe", attempt=1)

        async def load():                 # a load with WRITEs in flight: a cancel waits
            try:                          # for them (kvio.write_layers)
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                await writes_end.wait()
                raise
        st.tasks.append(asyncio.ensure_future(load()))
        d.requests["r1"] = st
        await asyncio.sleep(0)
        d.node.fences.hold = lambda *a, **kw: None
        d.cancel("r1")                    # the scheduler dropped it here: state gone
        await asyncio.sleep(0)
        assert "r1" not in d.requests
        stop = asyncio.ensure_future(d.stop("r1", 1, None))    # the PE asks
        for _ in range(20):
            await asyncio.sleep(0)
        assert not stop.done(), "answered while the load still writes into the PE"
        writes_end.set()
        assert await asyncio.wait_for(stop, 10) is True
        assert st.tasks[0].done() and d.ending == {}
        assert await d.stop("r1", 1, None) is False     # now truly not known

    asyncio.run(main())


def _writing_load(writes_end: asyncio.Event):
    async def load():                     # a load with WRITEs in flight: a cancel waits
        try:                              # for them (kvio.write_layers)
            await writes_end.wait()
        except asyncio.CancelledError:
            await writes_end.wait()
            raise
    return asyncio.ensure_future(load())


def test_a_fence_asking_after_prefill_done_waits_for_the_load_and_leaves_the_decode():
    async def main(writes_end: asyncio.Event, decoding: asyncio.Event):
        d = _path(asyncio.Event(), [])
        st = DecodeState("r1", engine=None, payload=None, plan=_plan(1), buffer=Slots(),
                         pe_address="pe", attempt=1)
        st.decoding = True                # PrefillDone came; the load still writes
        load = _writing_load(writes_end)
        decode = asyncio.ensure_future(decoding.wait())
        st.tasks += [load, decode]
        st.loads.append(load)
        d.requests["r1"] = st
        stop = asyncio.ensure_future(d.stop("r1", 1, None))    # the PE's fence asks
        for _ in range(20):
            await asyncio.sleep(0)
        assert not stop.done(), "answered while the load still writes into the PE"
        writes_end.set()
        assert await asyncio.wait_for(stop, 10) is True
        assert d.requests["r1"] is st and not decode.cancelled() and not decode.done()
        assert not st.buffer.released    # the decode still reads its prompt's blocks

    _run(main, 2)


def test_a_cancel_of_an_older_attempt_waits_for_it_and_leaves_the_newer_one():
    async def main(writes_end: asyncio.Event):
        d = _path(asyncio.Event(), [])
        d.node.fences.hold = lambda *a, **kw: None
        old = DecodeState("r1", engine=None, payload=None, plan=_plan(1), buffer=Slots(),
                          pe_address="pe", attempt=1)
        old.tasks.append(_writing_load(writes_end))
        d.requests["r1"] = old
        d.cancel("r1")                    # dropped (a newer attempt came) while writing
        new = DecodeState("r1", engine=None, payload=None, plan=_plan(1), buffer=Slots(),
                          pe_address="pe", attempt=2)
        d.requests["r1"] = new
        await asyncio.sleep(0)
        stop = asyncio.ensure_future(d.stop("r1", 1, None))    # no StaleAttempt
        for _ in range(20):
            await asyncio.sleep(0)
        assert not stop.done()
        writes_end.set()
        assert await asyncio.wait_for(stop, 10) is True
        assert d.requests["r1"] is new and not new.buffer.released

    _run(main, 1)


def _run(main, events: int) -> None:
    """``main(*events)``; the events are set however it ends, so a failed check cannot
    leave a load waiting for its writes for ever (the loop's end would hang)."""
    async def go():
        evs = [asyncio.Event() for _ in range(events)]
        try:
            await main(*evs)
        finally:
            for e in evs:
                e.set()
    asyncio.run(go())


def test_an_order_into_a_reservation_without_the_held_blocks_slots_is_refused():
    """A decode node that reads none of the hit for the PE gives the blocks its instance
    holds no slot (PrepareRequestResponse.first_slot_block): a read order for that
    request would land in the wrong slots, so it is refused before it starts."""
    from dualpath.errors import UsageError

    async def main():
        spawned: list = []
        d = _path(asyncio.Event(), spawned)
        st = DecodeState("r1", engine=None, payload=None, plan=_plan(3, held=2),
                         buffer=Slots(), pe_address="pe", attempt=1)
        d.requests["r1"] = st
        order = LoadOrder("r1", [bytes(16)], "pe",
                          KvPlacement.full_blocks(FMT, "hbm", 1024, 4), [0], 1, 0)
        with pytest.raises(UsageError, match="first 2 blocks have no slots"):
            await d.accept_order(order)
        return spawned

    assert asyncio.run(main()) == []


class _Pool:
    def __init__(self):
        self.held = []
        self.gate = asyncio.Event()
        self.gate.set()

    def check_size(self, n):
        pass

    async def reserve(self, n):
        await self.gate.wait()
        s = Slots()
        self.held.append(s)
        return s


def _preparing_path():
    from dualpath.paths.decode import PrepareCall

    d = _path(asyncio.Event(), [])
    d.decoder = EmulatedDecoder(d, None)
    d.ranks = {"de/e0": SimpleNamespace(tokens={})}
    d.space.buffer = "de_buffer"
    d.space.pool = _Pool()
    d.space.grant = lambda transfer, peer, res: SimpleNamespace(close=lambda: None)
    d.node.tokens = None
    d.node.metrics = SimpleNamespace(held_by_instance=SimpleNamespace(inc=lambda n: None))
    payload = SimpleNamespace(prompt_tokens=8, oracle=False, key_root=ROOT_KEY,
                              token_ids=lambda n, source: list(range(n)))

    def call(attempt, owner=None):
        return PrepareCall("r1", "de/e0", "pe", 8, 4, payload, attempt=attempt,
                           owner=owner)
    return d, call


def test_a_prepare_that_comes_after_its_attempts_cancel_is_refused():
    """The prefill node gave up on its PrepareRequest (no answer: a partition) and told
    the DE the attempt is cancelled; the PrepareRequest, still on its way, arrives
    after: it must not prepare a state nobody would ever end (the soak's leak: 7
    de_buffer slots and 384 read-queue tokens held until the node's lease was lost). A
    newer attempt is prepared as usual."""
    async def main():
        d, call = _preparing_path()
        assert not await d.stop("r1", 2, None)            # "not known": remembered
        with pytest.raises(StaleAttempt, match="cancelled that attempt"):
            await d.prepare(call(2))
        assert d.requests == {} and d.space.pool.held == []
        await d.prepare(call(3))
        assert d.requests["r1"].attempt == 3

    asyncio.run(main())


def test_another_callers_cancel_refuses_no_prepare():
    """Only the PE that cancelled its attempt has its late prepare refused: a cancel
    from any other cluster identity (it names a request it does not own) blocks no one."""
    async def main():
        d, call = _preparing_path()
        assert not await d.stop("r1", 99, "spiffe://dualpath/node/intruder")
        await d.prepare(call(2, owner="spiffe://dualpath/node/p0"))
        assert d.requests["r1"].attempt == 2

    asyncio.run(main())


def test_a_cancel_landing_while_the_prepare_waits_for_slots_ends_it_there():
    async def main():
        d, call = _preparing_path()
        d.space.pool.gate.clear()                         # the pool is full for now
        preparing = asyncio.ensure_future(d.prepare(call(2)))
        await asyncio.sleep(0)
        await d.stop("r1", 2, None)
        d.space.pool.gate.set()
        with pytest.raises(StaleAttempt, match="overtaken"):
            await preparing
        assert d.requests == {} and all(s.released for s in d.space.pool.held)

    asyncio.run(main())


def test_a_prefill_node_tells_the_cancel_until_the_decode_node_answers(monkeypatch):
    """The cancel of an unanswered PrepareRequest is tried again until the DE answers
    (through the partition that held the prepare back), a bounded number of times."""
    from dualpath.paths import peers as peers_mod
    from dualpath.paths.errors import PeerUnavailable

    calls = []

    async def stop(peer, rid, attempt, timeout_s):
        calls.append((peer, rid, attempt))
        if len(calls) < 3:
            raise PeerUnavailable("cut off")

    async def no_sleep(s):
        pass
    monkeypatch.setattr(peers_mod.asyncio, "sleep", no_sleep)
    pc = peers_mod.PeerClient.__new__(peers_mod.PeerClient)
    pc.stop = stop
    assert asyncio.run(pc.cancel_until_answered("de", "r1", 2)) is True
    assert calls == [("de", "r1", 2)] * 3
    calls.clear()
    assert asyncio.run(pc.cancel_until_answered("de", "r1", 2, tries=2)) is False
    assert len(calls) == 2
