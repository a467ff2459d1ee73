"""Which leading blocks of a prompt the front end expects stored (pure code).

The scheduler plans each request's reads from its hit length (paper §6). The front end
knows what it served: every block of a finished request's prompt and generated tokens
was persisted by its decode node (all but the last token's, whose KV is never
computed), keyed by DualPath's chained token-id keys (dualpath/kv/prefix.py). The
index remembers those keys (least recently used forgotten past ``capacity``) and
answers a new prompt's hit as its leading blocks found. A block the store lost is found
missing by the prefill node, which computes it: the hit is a plan, never a promise.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from dualpath.kv.prefix import ROOT_KEY, block_keys


class HitIndex:
    def __init__(self, block_tokens: int, capacity: int):
        self.block_tokens = block_tokens
        self.capacity = capacity
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def hit_tokens(self, ids: Sequence[int], root: bytes = ROOT_KEY) -> int:
        """Leading tokens of ``ids`` in remembered blocks (never the last token); keys
        chained from ``root``, the request's tenant's."""
        n = 0
        for k in block_keys(list(ids[:max(len(ids) - 1, 0)]), self.block_tokens, root):
            if k not in self._keys:
                break
            self._keys.move_to_end(k)
            n += 1
        return n * self.block_tokens

    def remember(self, prompt: Sequence[int], generated: Sequence[int],
                 root: bytes = ROOT_KEY) -> None:
        """A request finished: the full blocks of its prompt and output, less the last
        generated token, are stored now."""
        if not self.capacity:
            return
        ids = list(prompt) + list(generated)[:-1]
        for k in block_keys(ids, self.block_tokens, root):
            self._keys[k] = None
            self._keys.move_to_end(k)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)
