"""Prompt blocks a vLLM decode instance holds in its own prefix cache are not sent
(node.proto PrepareRequestResponse.held_blocks): the prefill node WRITEs none of them
(dualpath/engines/vllm/prefill.py _ToDecode) and the decode node adopts none of their
slots, which were never written (dualpath/engines/vllm/decode.py): a lookup must never
find such a slot's bytes under a block's key."""

from __future__ import annotations

import asyncio
import gc
from types import SimpleNamespace

from dualpath.buffers.pool import BlockPool, slot_stride
from dualpath.engines.vllm import prefill as vllm_prefill
from dualpath.engines.vllm.decode import VllmDecoder
from dualpath.engines.vllm.instance_cache import InstanceCache
from dualpath.kv.layout import BlockLayout
from dualpath.kv.prefix import block_keys, chain_key
from dualpath.kv.profiles import get_profile
from dualpath.paths.peers import Prepared
from dualpath.storage.store import aligned_bytes

T = 4
LAY = BlockLayout.of(get_profile("demo"))
IDS = list(range(100, 100 + 5 * T + 2))        # 5 full blocks and 2 tokens
KEYS = block_keys(IDS, T)[:5]
TAIL = chain_key(KEYS[-1], IDS[5 * T:])          # the partial last block's key


def _pool(slots: int) -> BlockPool:
    mem = aligned_bytes(slots * slot_stride(LAY))
    return BlockPool("de buffer", mem, LAY, region_addr=mem.ctypes.data)


def _to_decode(monkeypatch, held: int, base: int = 0, tail: bool = False):
    writes = []

    async def write_layers(transfer, peer, src, src_units, dst, dst_units, first, stop,
                           source=None):
        writes.append((list(src_units), list(dst_units), first, stop))
        return 0
    monkeypatch.setattr(vllm_prefill, "write_layers", write_layers)
    space = SimpleNamespace(fmt=SimpleNamespace(units=1, block_tokens=T), buffer="pe",
                            buffer_units=lambda res: [10 + i for i in range(len(res))])
    prep = Prepared(SimpleNamespace(units_of_slots=lambda slots: [20 + s for s in slots]),
                    tuple(range(5 + tail - base)), held, base)
    node = SimpleNamespace(transfer=None)
    if tail:
        return vllm_prefill._ToDecode(node, space, "r", "de", prep, KEYS + [TAIL]), writes
    return vllm_prefill._ToDecode(node, space, "r", "de", prep, KEYS), writes


def test_blocks_the_decode_instance_holds_are_not_written(monkeypatch):
    async def main():
        out, writes = _to_decode(monkeypatch, held=3)
        assert out.whole_prefix() == 3             # held counts as there
        out.push([0] * 2, 0, 2)                    # blocks 0, 1: all held
        out.push([0] * 5, 0, 5)                    # blocks 0..4: 3 and 4 go
        await out.wait()
        assert writes == [([13, 14], [23, 24], 0, 2 * T)]
        assert out.whole_prefix() == 5
    asyncio.run(main())


def test_held_blocks_without_slots_shift_the_rest(monkeypatch):
    """The DE gave no slot to the held blocks (it reads none of the hit): its slots
    start at block 3."""
    async def main():
        out, writes = _to_decode(monkeypatch, held=3, base=3)
        out.push([0] * 5, 0, 5)
        await out.wait()
        assert writes == [([13, 14], [20, 21], 0, 2 * T)]
        assert out.whole_prefix() == 5
    asyncio.run(main())


def test_a_push_that_fails_after_the_attempt_settled_is_not_reported(monkeypatch):
    """A save the instance ends after the attempt let go starts a push nobody gathers;
    its DE dead, it fails: asyncio must not report an unretrieved error."""
    seen: list = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda _l, ctx: seen.append(ctx))
        out, _ = _to_decode(monkeypatch, held=0)

        async def refused(*a, **kw):
            raise vllm_prefill.TransferError("peer is unreachable: connection refused")
        monkeypatch.setattr(vllm_prefill, "write_layers", refused)
        out.push([0] * 5, 0, 5)
        await asyncio.sleep(0.01)
        out.pushes.clear()                         # nobody holds it any more
        gc.collect()
        await asyncio.sleep(0)
    asyncio.run(main())
    assert [c for c in seen if "never retrieved" in c.get("message", "")] == []


def test_nothing_held_sends_everything(monkeypatch):
    async def main():
        out, writes = _to_decode(monkeypatch, held=0)
        assert out.whole_prefix() == 0
        out.push([0] * 5, 0, 5)
        await out.wait()
        assert writes == [([10, 11, 12, 13, 14], [20, 21, 22, 23, 24], 0, 5 * T)]
    asyncio.run(main())


def test_the_partial_last_block_goes_to_the_slot_after_the_full_ones(monkeypatch):
    """The instance saves the prompt's partial last block (2 tokens) after its full
    blocks: it goes whole to the DE's slot after them (a K plane is element-major on
    vLLM's CPU backend: no byte range holds just its tokens), and counts in
    PrefillDone.kv_blocks once there (one past the full blocks)."""
    async def main():
        out, writes = _to_decode(monkeypatch, held=3, tail=True)
        pool = _pool(3)
        full = pool.try_reserve(2)
        out.on_saved(KEYS[3:], full)               # blocks 3, 4: whole
        await out.wait()
        assert out.whole_prefix() == 5
        part = pool.try_reserve(1)
        out.on_saved([TAIL], part)
        await out.wait()
        assert writes[-1] == ([10], [25], 0, T)    # the 6th slot
        assert out.whole_prefix() == 6
        out.push([0] * 6, 0, 6)                    # a staged whole: 3, 4 and the tail
        await out.wait()
        assert writes[-1] == ([13, 14, 15], [23, 24, 25], 0, 3 * T)
        assert pool.free == pool.capacity          # each save's slots let go
    asyncio.run(main())


class _Engine:
    def __init__(self):
        self.space = SimpleNamespace(fmt=SimpleNamespace(block_tokens=T))
        self.instance_cache = InstanceCache(16)
        self.salts: dict[str, str] = {}
        self.adopted = []
        self.salt_seen = None

    def adopt(self, rid, keys, res, tail=False):
        self.adopted.append((list(keys), tuple(res.slots)) + ((True,) if tail else ()))
        return res

    def release_adopted(self, res):
        res.release()


class _Instance:
    def __init__(self, engine: _Engine):
        self.engine = engine

    async def complete(self, ids, n, **kw):
        self.engine.salt_seen = self.engine.salts.get(kw["request_id"])
        return SimpleNamespace(token_ids=[7] * n, logprobs=[-0.5] * n, top=[],
                               finish_reason="length")


def _decode(held: int, base: int = 0, kv_blocks: int = 5):
    eng = _Engine()
    pool = _pool(6)
    res = pool.try_reserve(6 - base)              # 5 full blocks and the partial one
    payload = SimpleNamespace(prompt_tokens=len(IDS), token_ids=lambda n, tok: IDS,
                              stream=False, sink="", gen_tokens=3, cache_salt="s",
                              temperature=0.0, top_p=1.0, seed=-1, ignore_eos=True,
                              sampling={}, oracle=False, tenant="")
    st = SimpleNamespace(payload=payload, request_id="r", attempt=1, buffer=res,
                         spans=[SimpleNamespace(key=k) for k in KEYS + [TAIL]], held=held,
                         base=base)
    done = SimpleNamespace(kv_blocks=kv_blocks, first_token=(1, -0.1, False), first_top=None,
                           done_unix_s=1.0)
    timings = SimpleNamespace(first_token_unix_s=0.0, second_token_unix_s=0.0)
    dec = VllmDecoder(SimpleNamespace(tokens=None), eng, _Instance(eng))
    return eng, pool, res, dec, st, done, timings


def test_the_decode_node_adopts_only_the_blocks_it_was_sent():
    eng, pool, res, dec, st, done, timings = _decode(held=2)
    asyncio.run(dec.run(st, done, timings))
    assert eng.adopted == [(KEYS[2:5], res.slots[2:5])]
    assert pool.free == pool.capacity              # the rest at once, the adopted after
    assert eng.salt_seen == "s" and eng.salts == {}
    assert timings.output_token_ids == (1, 7, 7)


def test_held_blocks_without_slots_adopt_the_whole_reservation():
    eng, pool, res, dec, st, done, timings = _decode(held=2, base=2)
    asyncio.run(dec.run(st, done, timings))
    assert eng.adopted == [(KEYS[2:5], res.slots)]   # block 2 in its first slot
    assert pool.free == pool.capacity


def test_nothing_held_adopts_every_block_sent():
    eng, _, res, dec, st, done, timings = _decode(held=0)
    asyncio.run(dec.run(st, done, timings))
    assert eng.adopted == [(KEYS, res.slots)]


def test_held_is_the_leading_full_blocks_in_the_instance_cache():
    eng, _, _, dec, st, _, _ = _decode(held=0)
    eng.instance_cache.add("s", KEYS[:3] + KEYS[4:])
    assert dec.held(st.payload, st.spans) == 3
    assert dec.held(SimpleNamespace(**{**vars(st.payload), "cache_salt": ""}),
                    st.spans) == 0
    eng.instance_cache = None                      # vLLM's prefix cache off
    assert dec.held(st.payload, st.spans) == 0


def test_the_partial_last_block_is_adopted_only_when_it_came():
    """kv_blocks one past the full blocks: the PE sent the partial last block's tokens,
    adopted with the rest as the tail (served, never persisted); kv_blocks = 5: it did
    not come, and its slot is no lookup's."""
    eng, pool, res, dec, st, done, timings = _decode(held=2, kv_blocks=6)
    asyncio.run(dec.run(st, done, timings))
    assert eng.adopted == [(KEYS[2:5] + [TAIL], res.slots[2:6], True)]
    assert pool.free == pool.capacity
    eng, _, res, dec, st, done, timings = _decode(held=0, kv_blocks=5)
    asyncio.run(dec.run(st, done, timings))
    assert eng.adopted == [(KEYS, res.slots)]
