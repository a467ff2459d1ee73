"""Prefix identity: chained block hashes over token ids (pure code, no I/O).

The key of block ``i`` is ``H(key of block i-1 || token ids of block i)``, starting from
a fixed root key, so a block's key names *every* token before it and not only its own.
A set of such keys is therefore a trie over token sequences (paper appendix A.5: "a
trie in distributed storage, one Full Block per node"): a key is a node, its parent is
the previous block's key, and two prompts share exactly the blocks of their common
prefix. Only full blocks are keyed; a trailing partial block never hits.

``H`` is BLAKE2b with a 16-byte digest (stable across processes, platforms and Python
versions, unlike ``hash()``); token ids are hashed as little-endian uint32.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import numpy as np

from dualpath.errors import UsageError

KEY_BYTES = 16
_PERSON = b"dualpath-kv-v1"   # domain separation: these keys are ours and versioned
ROOT_KEY = hashlib.blake2b(b"root", digest_size=KEY_BYTES, person=_PERSON).digest()


def _token_bytes(tokens) -> bytes:
    arr = np.asarray(tokens)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise UsageError(f"token ids must be a 1-D sequence of ints, got {arr.dtype} {arr.shape}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF):
        raise UsageError("token ids must be in 0..2**32-1")
    return arr.astype("<u4", copy=False).tobytes()


def chain_key(parent: bytes, block_tokens_ids) -> bytes:
    """The key of one block given its parent's key and its own token ids."""
    h = hashlib.blake2b(parent, digest_size=KEY_BYTES, person=_PERSON)
    h.update(_token_bytes(block_tokens_ids))
    return h.digest()


def block_keys(tokens: Sequence[int], block_tokens: int, parent: bytes = ROOT_KEY) -> list[bytes]:
    """Keys of every *full* block of ``tokens`` (a trailing partial block has none)."""
    if block_tokens <= 0:
        raise UsageError(f"block_tokens must be > 0, got {block_tokens}")
    arr = np.asarray(tokens)
    keys = []
    for start in range(0, len(arr) - block_tokens + 1, block_tokens):
        parent = chain_key(parent, arr[start:start + block_tokens])
        keys.append(parent)
    return keys


class PrefixChain:
    """Incremental keys for a growing sequence (a decode stream appends tokens).

    ``extend`` returns ``(key, token_ids)`` for each block that the new tokens complete.
    Not thread-safe: one owner (the request's task) feeds it.
    """

    def __init__(self, block_tokens: int, parent: bytes = ROOT_KEY, pending: Sequence[int] = ()):
        if block_tokens <= 0:
            raise UsageError(f"block_tokens must be > 0, got {block_tokens}")
        self.block_tokens = block_tokens
        self.last_key = parent
        self.blocks = 0
        self._pending: list[int] = []
        self._done = self.extend(pending)   # a prompt may already hold full blocks

    @classmethod
    def for_prompt(cls, tokens: Sequence[int], block_tokens: int) -> PrefixChain:
        """A chain positioned after ``tokens``: full blocks keyed, the tail pending."""
        return cls(block_tokens, pending=tokens)

    @property
    def pending_tokens(self) -> int:
        """Tokens of the current, not yet full, block."""
        return len(self._pending)

    def extend(self, tokens: Iterable[int]) -> list[tuple[bytes, list[int]]]:
        done = []
        for t in tokens:
            self._pending.append(int(t))
            if len(self._pending) == self.block_tokens:
                self.last_key = chain_key(self.last_key, self._pending)
                self.blocks += 1
                done.append((self.last_key, self._pending))
                self._pending = []
        return done


def lookup(index, tokens: Sequence[int], block_tokens: int) -> int:
    """How many leading tokens of ``tokens`` hit ``index`` (a multiple of ``block_tokens``).

    ``index`` is anything with ``contains(key)`` (a BlockStore, a PrefixIndex) or a
    container supporting ``key in index``. The walk stops at the first missing block:
    a block past a hole is useless to a prefill that must start at the hole.
    """
    contains = getattr(index, "contains", None) or index.__contains__
    hit = 0
    for key in block_keys(tokens, block_tokens):
        if not contains(key):
            break
        hit += block_tokens
    return hit


class PrefixIndex:
    """An in-memory trie of stored blocks, keyed by their chained keys.

    Because each key already names its whole prefix, membership needs only a set; the
    children map lets removing a node drop its now unreachable descendants too.
    Not thread-safe: one owner.
    """

    def __init__(self) -> None:
        self._children: dict[bytes, list[bytes]] = {ROOT_KEY: []}

    def __len__(self) -> int:
        return len(self._children) - 1

    def __contains__(self, key: bytes) -> bool:
        return key != ROOT_KEY and key in self._children

    contains = __contains__

    def add(self, key: bytes, parent: bytes = ROOT_KEY) -> None:
        if parent not in self._children:
            raise UsageError(f"parent block {parent.hex()} is not in the index")
        if key not in self._children:
            self._children[key] = []
            self._children[parent].append(key)

    def add_prompt(self, tokens: Sequence[int], block_tokens: int) -> list[bytes]:
        """Insert every full block of ``tokens``; returns their keys."""
        keys = block_keys(tokens, block_tokens)
        for parent, key in zip([ROOT_KEY, *keys], keys):
            self.add(key, parent)
        return keys

    def remove(self, key: bytes) -> int:
        """Remove ``key`` and its whole subtree; returns how many nodes went."""
        if key not in self:
            return 0
        for kids in self._children.values():   # unlink from its parent
            if key in kids:
                kids.remove(key)
                break
        gone, stack = 0, [key]
        while stack:
            k = stack.pop()
            stack.extend(self._children.pop(k))
            gone += 1
        return gone
