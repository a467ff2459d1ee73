"""Prefix identity: chained block hashes over token ids (pure code, no I/O).

The key of block ``i`` is ``H(key of block i-1 || token ids of block i)``, starting from
a fixed root key, so a block's key names *every* token before it and not only its own.
A set of such keys is therefore a trie over token sequences (paper appendix A.5: "a
trie in distributed storage, one Full Block per node"): a key is a node, its parent is
the previous block's key, and two prompts share exactly the blocks of their common
prefix. Only full blocks are keyed; a trailing partial block never hits.

``H`` is BLAKE2b (stable across processes, platforms and Python versions, unlike
``hash()``); token ids are hashed as little-endian uint32. A key is 16 bytes: the first
13 of the digest, then the 3-byte **tag** of the tenant's account, copied from the root
down every chain (:func:`key_tag`), so the store can charge a block to its tenant's
quota from its key alone (dualpath/storage/lru.py). The default tenant's tag is 0.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from dualpath.errors import UsageError

KEY_BYTES = 16
TAG_BYTES = 3
_HASHED = KEY_BYTES - TAG_BYTES
_PERSON = b"dualpath-kv-v1"   # domain separation: these keys are ours and versioned
MAX_TENANT_CHARS = 256
DEFAULT_TAG = 0
ROOT_KEY = hashlib.blake2b(b"root", digest_size=KEY_BYTES,
                           person=_PERSON).digest()[:_HASHED] + bytes(TAG_BYTES)


def account_of(tenant: str) -> str:
    """The account a tenant's blocks are charged to: its name up to the first ``/``
    (the front end names an API key's tenant ``acct`` and its requests' salts
    ``acct/salt``: one quota, separate hits)."""
    return tenant.split("/", 1)[0]


def tenant_tag(tenant: str) -> int:
    """The tag of ``tenant``'s account (24 bits; 0 only for the default tenant). Two
    accounts may share a tag (one in 2^24): their quotas are then one; their hits never
    are (the root key hashes the whole name)."""
    account = account_of(tenant)
    if not account:
        return DEFAULT_TAG
    d = hashlib.blake2b(b"account\0" + account.encode(), digest_size=TAG_BYTES,
                        person=_PERSON).digest()
    return int.from_bytes(d, "little") or 1


def key_tag(key: bytes) -> int:
    """The tenant tag a block key carries (its last :data:`TAG_BYTES`, also of a key
    with a prefix before it)."""
    return int.from_bytes(key[-TAG_BYTES:], "little")


def tenant_root(tenant: str) -> bytes:
    """The root key of ``tenant``'s chains: a tenant's blocks are never another's hit,
    however equal their tokens (the prefix-cache side channel between tenants stays
    closed in storage too). The default tenant (``""``) has :data:`ROOT_KEY`, the root
    of every chain before tenants, so blocks stored then stay its hits."""
    if not tenant:
        return ROOT_KEY
    if not isinstance(tenant, str) or len(tenant) > MAX_TENANT_CHARS:
        raise UsageError(f"a tenant is a string of at most {MAX_TENANT_CHARS} characters")
    d = hashlib.blake2b(b"tenant\0" + tenant.encode(), digest_size=KEY_BYTES,
                        person=_PERSON).digest()
    return d[:_HASHED] + tenant_tag(tenant).to_bytes(TAG_BYTES, "little")


def _token_bytes(tokens) -> bytes:
    arr = np.asarray(tokens)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise UsageError(f"token ids must be a 1-D sequence of ints, got {arr.dtype} {arr.shape}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF):
        raise UsageError("token ids must be in 0..2**32-1")
    return arr.astype("<u4", copy=False).tobytes()


def chain_key(parent: bytes, block_tokens_ids) -> bytes:
    """The key of one block given its parent's key and its own token ids (it carries
    the parent's tenant tag)."""
    h = hashlib.blake2b(parent, digest_size=KEY_BYTES, person=_PERSON)
    h.update(_token_bytes(block_tokens_ids))
    return h.digest()[:_HASHED] + parent[_HASHED:]


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
