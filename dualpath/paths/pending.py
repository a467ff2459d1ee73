"""The one index of a node's KV blocks on their way to disk (pure; the node's loop).

A block counts as stored as soon as it is committed (a lookup hits it), but it reaches
the store only later, paced by the storage NIC's write direction. Until then it is in
this node's DRAM, held by whoever will write it: a write-back slot (paths/writeback.py,
an emulated DE's new blocks) or a vLLM save's slots (engines/vllm/engine.py, a save or a
P/D request's adopted prompt). Several holders may hold one key (requests that share a
prefix each hold its blocks until their own decode loaded them); the first serves it and
the next takes over when it lets go. Every read of this node looks here first and copies
the block from DRAM (read-your-writes: KvSpace.read, a vLLM load); another node finds it
missing and computes it.

A holder is anything with ``flat(i)``: the ``i``-th block's bytes (a Reservation, a save).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import numpy as np


class Holder(Protocol):
    def flat(self, i: int) -> np.ndarray: ...


class PendingBlocks:
    """key -> its holders, in the order they came; the first serves the key."""

    def __init__(self):
        self._held: dict[bytes, list[tuple[Holder, int]]] = {}

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, key: object) -> bool:
        return key in self._held

    def add(self, key: bytes, holder: Holder, index: int = 0) -> None:
        """``holder``'s block ``index`` is ``key``, on its way to disk."""
        self._held.setdefault(key, []).append((holder, index))

    def remove(self, key: bytes, holder: Holder) -> None:
        """``holder`` no longer holds ``key`` (idempotent); another holder, if any, serves
        it from now on."""
        held = self._held.get(key)
        if held is None:
            return
        held[:] = [h for h in held if h[0] is not holder]
        if not held:
            del self._held[key]

    def serving(self, key: bytes) -> tuple[Holder, int] | None:
        """(holder, index) that serves ``key``, or None when it is not pending."""
        held = self._held.get(key)
        return held[0] if held else None

    def get(self, key: bytes) -> np.ndarray | None:
        """The bytes of ``key`` while it is pending (a view: copy it before awaiting
        anything, or pin its holder), else None."""
        held = self._held.get(key)
        return held[0][0].flat(held[0][1]) if held else None

    def servers(self) -> Iterator[Holder]:
        """Each holder that serves some key (once)."""
        seen: set[int] = set()
        for held in self._held.values():
            h = held[0][0]
            if id(h) not in seen:
                seen.add(id(h))
                yield h
