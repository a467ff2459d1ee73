"""Decode side: persist each block of new tokens as soon as it fills (paper §4.1).

A decode engine appends tokens to a request; every time they complete a block (the
prompt's partial tail counts), that block's KV (all layers) is staged in a DE-buffer
slot and written to the store, so a later turn of the same agent finds it. Keys come
from :class:`dualpath.kv.prefix.PrefixChain`, so the block is named by its whole prefix.

The KV bytes come from ``fill(stage, key, token_ids)``. An engine with a real model
copies them out of HBM; the default writes synthetic KV, which stands in for the
model's output (dualpath.kv.synth).

Threads: one asyncio task (the request's) drives a persister.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np

from dualpath.errors import UsageError
from dualpath.kv.prefix import PrefixChain
from dualpath.kv.synth import SyntheticKV
from dualpath.storage.store import BlockStore

Fill = Callable[[np.ndarray, bytes, Sequence[int]], None]


class BlockPersister:
    """Writes each full block of a growing token sequence to ``store`` as it completes."""

    def __init__(self, store: BlockStore, stage: np.ndarray, chain: PrefixChain,
                 fill: Fill | None = None):
        if chain.block_tokens != store.profile.block_tokens:
            raise UsageError(f"prefix chain uses {chain.block_tokens}-token blocks, the store "
                             f"{store.profile.block_tokens}")
        if stage.size != store.layout.full_bytes:
            raise UsageError(f"staging buffer holds {stage.size} bytes, a block is "
                             f"{store.layout.full_bytes}")
        self.store = store
        self.stage = stage
        self.chain = chain
        if fill is None:
            synth = SyntheticKV(store.layout)
            fill = lambda out, key, _tokens: synth.fill_full(out, key)
        self.fill = fill
        self.persisted: list[bytes] = []     # keys written by this persister, in order
        self.already_stored = 0              # completed blocks another writer had stored

    @classmethod
    def for_prompt(cls, store: BlockStore, stage: np.ndarray, prompt: Sequence[int],
                   fill: Fill | None = None) -> BlockPersister:
        """Positioned after ``prompt``: its tail tokens start the first new block."""
        return cls(store, stage, PrefixChain.for_prompt(prompt, store.profile.block_tokens), fill)

    async def append(self, tokens: Iterable[int]) -> list[bytes]:
        """Add generated tokens; write every block they complete. Returns those keys."""
        written = []
        for key, ids in self.chain.extend(tokens):
            self.fill(self.stage, key, ids)
            if await self.store.awrite(key, self.stage):
                written.append(key)
            else:
                self.already_stored += 1
        self.persisted += written
        return written
