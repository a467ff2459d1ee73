"""What a vLLM prefill instance's own prefix cache likely holds: a hint, never a promise.

vLLM keeps the KV of the blocks it computed or loaded in its prefix cache until it needs
the room (least recently used first). A prefill node sees every block its instance
computes (its saves) and every block it loads (the stage's loads), so it can tell,
before it stages a hit, whether the instance will find that hit in its own memory; then
it stages nothing and the instance's saves send the blocks on to the decode node. The
hint is an LRU of block keys bounded by the instance's KV capacity: it can be wrong when
vLLM evicts sooner (blocks of running requests are not evictable), and then vLLM
computes what it lacks: slower, never other bytes (the connector loads nothing it was
not staged). Keys carry the request's cache salt: vLLM's prefix cache does not share
blocks across salts.

Pure; the node's event loop owns it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class InstanceCache:
    """An LRU of (salt, block key) up to ``capacity`` blocks."""

    def __init__(self, capacity: int):
        self.capacity = max(0, capacity)
        self._keys: OrderedDict[tuple[str, bytes], None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, salt: str, keys: Sequence[bytes]) -> None:
        """The instance computed or loaded ``keys`` (in prompt order) just now."""
        for k in keys:
            self._keys[(salt, k)] = None
            self._keys.move_to_end((salt, k))
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def leading(self, salt: str, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` the instance likely holds (a prefix cache hit ends at
        the first block it lacks)."""
        n = 0
        for k in keys:
            if (salt, k) not in self._keys:
                break
            n += 1
        return n

    def clear(self) -> None:
        """The instance started again: its cache is empty."""
        self._keys.clear()
