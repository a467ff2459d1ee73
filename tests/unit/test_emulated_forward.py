"""A PE's forward steps (engines/emulated/forward.py): batches under the quota and HBM, a layer of
HBM at a time with layerwise prefill, chunks, failures and withdrawals, and the engines
of a node stepping together. Jobs are small fakes that record what the forward asks of
them; the step's sleep is recorded instead of slept."""

import asyncio
import itertools

import numpy as np
import pytest

from dualpath.buffers.pool import BlockPool
from dualpath.engines.emulated.batching import ProfileEstimate
from dualpath.engines.emulated.forward import DEPTH, PrefillForward
from dualpath.kv import cost
from dualpath.kv.layout import BlockLayout
from dualpath.kv.placement import KvFormat
from dualpath.kv.profiles import get_profile
from dualpath.paths.errors import RequestFailed
from dualpath.paths.ranks import EngineRank

PROFILE = get_profile("demo")                    # 8 layers, 64-token blocks
LAYOUT = BlockLayout(PROFILE.layers, PROFILE.block_tokens, 16)
FMT = KvFormat.flat(LAYOUT)
T, L = PROFILE.block_tokens, PROFILE.layers


class Pool(BlockPool):
    """An HBM pool that remembers the most slots it ever had out at once."""

    def __init__(self, slots: int):
        super().__init__("hbm0", np.zeros(slots * 4096, np.uint8), LAYOUT.one_layer())
        self.peak = 0

    def _take(self, n):
        r = super()._take(n)
        self.peak = max(self.peak, self.capacity - self.free)
        return r


class Job:
    def __init__(self, rid, prompt, events, *, fail_at=None, slow=0):
        self.request_id, self.prompt_tokens = rid, prompt
        self.moves_kv = True
        self.events, self.fail_at, self.slow = events, fail_at, slow
        self.written: dict[int, list[tuple[int, int]]] = {}

    async def _turns(self):
        for _ in range(self.slow):
            await asyncio.sleep(0)

    async def wait_for_layer_load(self, layer, window, stop):
        self.events.append(("load", self.request_id, layer, stop))
        await self._turns()

    def write(self, layer, window, first, stop, blocks):
        if layer == self.fail_at:
            raise RuntimeError(f"injected at layer {layer}")
        assert len(blocks) == -(-stop // T)
        self.written.setdefault(layer, []).append((first, stop))
        self.events.append(("compute", self.request_id, layer))

    async def save_kv_layer(self, layer, window, first, stop, last):
        await self._turns()
        self.events.append(("sent", self.request_id, layer, first, stop, last))


def forward(ranks, *, quota_s=10.0, slept=None):
    async def sleep(s):
        if slept is not None:
            slept.append(s)
        await asyncio.sleep(0)
    return PrefillForward(PROFILE, FMT, ranks, ProfileEstimate(PROFILE), quota_s=quota_s,
                          sleep=sleep)


def rank(i=0, slots=4096):
    return EngineRank(f"p0/e{i}", i, f"hbm{i}", Pool(slots))


def run(coro):
    return asyncio.run(coro)


def test_requests_queued_together_share_one_step_timed_as_their_batch():
    events, slept = [], []

    async def main():
        e = rank()
        fw = forward([e], slept=slept)
        jobs = [Job(f"r{i}", 4 * T + 10, events) for i in range(3)]
        await asyncio.gather(*(fw.compute(e, j, 4 * T, True) for j in jobs))
        return fw, jobs
    fw, jobs = run(main())
    assert len(fw.steps) == 1 and fw.steps[0].requests == (3,)
    layer_s, _ = cost.group_layer_time(PROFILE, [[(4 * T, 10)] * 3])
    assert slept == pytest.approx([layer_s] * L)
    for j in jobs:                       # every layer computed once, the new tokens only
        assert j.written == {layer: [(4 * T, 4 * T + 10)] for layer in range(L)}
        # The last layer's send says it was the request's last chunk.
        assert ("sent", j.request_id, L - 1, 4 * T, 4 * T + 10, True) in events


def test_layerwise_holds_a_few_layers_of_hbm_and_moves_the_next_layer_in_early():
    for layerwise, held_layers in ((True, DEPTH), (False, L)):
        events = []

        async def main(events=events, layerwise=layerwise):
            e = rank()
            fw = forward([e])
            await fw.compute(e, Job("r", 8 * T + 1, events, slow=3), 8 * T, layerwise)
            return e
        e = run(main())
        assert e.hbm.peak == 9 * held_layers          # 9 blocks of context per layer
        assert e.hbm.free == e.hbm.capacity
        order = [(k, layer) for k, _, layer, *_ in events if k in ("load", "compute")]
        if layerwise:   # layer 1 starts moving in before layer 0 computes
            assert order.index(("load", 1)) < order.index(("compute", 0))
        else:           # every layer is in before layer 0 computes
            assert max(order.index(("load", x)) for x in range(L)) < \
                order.index(("compute", 0))


def test_hbm_bounds_the_batch_and_the_rest_waits_fifo():
    events = []

    async def main():
        e = rank(slots=3 * 2 * DEPTH)    # room for three 2-block requests' windows
        fw = forward([e])
        jobs = [Job(f"r{i}", 2 * T, events) for i in range(5)]
        await asyncio.gather(*(fw.compute(e, j, T, True) for j in jobs))
        return fw
    fw = run(main())
    assert [s.requests for s in fw.steps] == [(3,), (2,)]
    # The first batch was full (two requests' T new tokens left queued), the last not.
    assert [s.left_tokens for s in fw.steps] == [(2 * T,), (0,)]


def test_a_request_over_the_quota_is_chunked_and_each_chunk_loads_the_last():
    events = []
    quota = cost.prefill_s(PROFILE, [(0, 300)])

    async def main():
        e = rank()
        fw = forward([e], quota_s=quota)
        j = Job("big", 1000, events, slow=2)
        await fw.compute(e, j, 0, True)
        return fw, j
    fw, j = run(main())
    assert len(fw.steps) >= 3
    # Every chunk's step but the last left the rest of the request queued.
    steps = list(fw.steps)
    assert [s.left_tokens[0] for s in steps] == \
        [1000 - sum(x.tokens[0] for x in steps[:i + 1]) for i in range(len(steps))]
    assert fw.steps[-1].left_tokens == (0,)
    spans = j.written[0]
    assert spans[0][0] == 0 and spans[-1][1] == 1000
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))   # each token once
    for layer in range(L):
        assert j.written[layer] == spans
    # A chunk that is not the last sends its KV back to the PE buffer (last=False), and
    # the next chunk's load of layer 0 comes after that chunk's sends all ended.
    first_stop = spans[0][1]
    sent = [i for i, ev in enumerate(events) if ev[0] == "sent" and ev[4] == first_stop]
    assert all(not events[i][5] for i in sent)
    load2 = events.index(("load", "big", 0, first_stop))
    assert max(sent) < load2


def test_a_failing_request_fails_alone_and_gives_its_hbm_back():
    events = []

    async def main():
        e = rank()
        fw = forward([e])
        good, bad = Job("good", 2 * T, events), Job("bad", 2 * T, events, fail_at=3)
        res = await asyncio.gather(fw.compute(e, good, T, True),
                                   fw.compute(e, bad, T, True), return_exceptions=True)
        return e, good, bad, res
    e, good, bad, res = run(main())
    assert res[0] is None
    assert isinstance(res[1], RuntimeError) and "layer 3" in str(res[1])
    assert sorted(good.written) == list(range(L))
    assert sorted(bad.written) == [0, 1, 2]
    assert e.hbm.free == e.hbm.capacity


def test_a_cancelled_request_returns_only_once_its_moves_ended():
    events = []

    async def main():
        e = rank()
        fw = forward([e])
        j = Job("r", 4 * T, events, slow=20)
        t = asyncio.ensure_future(fw.compute(e, j, 2 * T, True))
        while not any(ev[0] == "compute" for ev in events):
            await asyncio.sleep(0)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        events.append(("returned",))
        await fw.close()
        return e
    e = run(main())
    last_move = max(i for i, ev in enumerate(events) if ev[0] in ("load", "sent"))
    assert events.index(("returned",)) > last_move
    assert e.hbm.free == e.hbm.capacity


def test_engines_step_together_and_the_step_records_each_ones_attention():
    events = []

    async def main():
        e0, e1 = rank(0), rank(1)
        fw = forward([e0, e1])
        await asyncio.gather(fw.compute(e0, Job("a", 40 * T + 64, events), 40 * T, True),
                             fw.compute(e1, Job("b", 4 * T + 64, events), 4 * T, True))
        return fw
    fw = run(main())
    assert len(fw.steps) == 1
    s = fw.steps[0]
    assert s.requests == (1, 1) and s.tokens == (64, 64)
    heavy = cost.forward_time(PROFILE, [(40 * T, 64)]).attention_s
    light = cost.forward_time(PROFILE, [(4 * T, 64)]).attention_s
    assert s.attention_s == pytest.approx((heavy, light))


def test_a_request_that_never_fits_the_hbm_is_refused_with_a_reason():
    async def main():
        e = rank(slots=4)
        fw = forward([e])
        with pytest.raises(RequestFailed, match="HBM"):
            await fw.compute(e, Job("r", 10 * T, []), 0, False)
    run(main())
