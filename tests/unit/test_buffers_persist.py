"""Decode-side persistence: each block of new tokens is written as soon as it fills."""

import asyncio

from dualpath.buffers.persist import BlockPersister
from dualpath.kv.prefix import block_keys, lookup
from dualpath.kv.profiles import get_profile
from dualpath.kv.synth import SyntheticKV
from dualpath.storage import BlockStore
from dualpath.storage.store import aligned_bytes

PROFILE = get_profile("demo", 4)


def test_blocks_are_persisted_when_they_fill_and_then_hit(tmp_path):
    prompt = list(range(6))                       # one full block + 2 pending tokens
    decoded = list(range(100, 111))               # 17 tokens: blocks 1..3 fill, 1 pending

    async def main(store):
        p = BlockPersister.for_prompt(store, aligned_bytes(store.layout.full_bytes), prompt)
        assert await p.append(decoded[:1]) == []  # 3 of 4 tokens: not yet
        first = await p.append(decoded[1:2])      # the 4th token fills block 1
        rest = await p.append(decoded[2:])
        return p, first, rest

    with BlockStore(tmp_path, PROFILE) as store:
        p, first, rest = asyncio.run(main(store))
        keys = block_keys(prompt + decoded, 4)
        assert first == [keys[1]] and rest == keys[2:4] and p.chain.pending_tokens == 1
        synth = SyntheticKV(store.layout)
        out = aligned_bytes(store.layout.full_bytes)
        assert store.read_into(keys[2], out) and synth.verify_full(out, keys[2]) is None
        # the prompt's own block 0 was the prefill's to store: lookup stops there
        assert lookup(store, prompt + decoded, 4) == 0
        store.write(keys[0], synth.full_block(keys[0]))
        assert lookup(store, prompt + decoded, 4) == 16


def test_custom_fill_and_blocks_already_stored(tmp_path):
    seen = []

    def fill(out, key, ids):                     # what an engine with HBM would do
        seen.append(list(ids))
        SyntheticKV(store.layout).fill_full(out, key)

    with BlockStore(tmp_path, PROFILE) as store:
        key0 = block_keys([1, 2, 3, 4], 4)[0]
        store.write(key0, SyntheticKV(store.layout).full_block(key0))
        p = BlockPersister.for_prompt(store, aligned_bytes(store.layout.full_bytes), [], fill)
        assert asyncio.run(p.append([1, 2, 3, 4])) == []
        assert seen == [[1, 2, 3, 4]] and p.already_stored == 1
