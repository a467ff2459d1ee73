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
from collections.abc import Sequence

import numpy as np

from dualpath.errors import UsageError

KEY_BYTES = 16
_PERSON = b"dualpath-kv-v1"   # domain separation: these keys are ours and versioned
ROOT_KEY = hashlib.blake2b(b"root", digest_size=KEY_BYTES, person=_PERSON).digest()
MAX_TENANT_CHARS = 256


def tenant_root(tenant: str) -> bytes:
    """The root key of ``tenant``'s chains: a tenant's blocks are never another's hit,
    however equal their tokens (the prefix-cache side channel between tenants stays
    closed in storage too). The default tenant (``""``) has :data:`ROOT_KEY`, the root
    of every chain before tenants, so blocks stored then stay its hits."""
    if not tenant:
        return ROOT_KEY
    if not isinstance(tenant, str) or len(tenant) > MAX_TENANT_CHARS:
        raise UsageError(f"a tenant is a string of at most {MAX_TENANT_CHARS} characters")
    return hashlib.blake2b(b"tenant\0" + tenant.encode(), digest_size=KEY_BYTES,
                           person=_PERSON).digest()


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
