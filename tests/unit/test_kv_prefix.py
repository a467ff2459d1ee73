"""Prefix identity: chained block keys (a key names every token before it)."""

import hashlib

import numpy as np

from dualpath.kv.prefix import ROOT_KEY, block_keys, chain_key, key_tag, tenant_root, tenant_tag

BT = 4


def test_key_is_blake2b_of_parent_and_le_uint32_tokens():
    # Re-derived from the spec in dualpath/kv/prefix.py's docstring.
    tokens = [1, 2, 3, 70000]
    h = hashlib.blake2b(ROOT_KEY, digest_size=16, person=b"dualpath-kv-v1")
    h.update(np.array(tokens, dtype="<u4").tobytes())
    want = h.digest()[:13] + bytes(3)          # the default tenant's tag: 0
    assert chain_key(ROOT_KEY, tokens) == want
    assert block_keys(tokens, 4) == [want]


def test_every_key_of_a_chain_carries_its_tenants_account_tag():
    ids = list(range(40))
    for tenant in ("", "acme", "acme/session-1", "beta"):
        keys = block_keys(ids, BT, tenant_root(tenant))
        assert {key_tag(k) for k in keys} == {tenant_tag(tenant)}
    # An account's salted sub-tenants share its tag (one quota), never its keys (hits).
    assert tenant_tag("acme/session-1") == tenant_tag("acme") != tenant_tag("beta")
    assert tenant_tag("") == 0 and tenant_tag("acme") != 0
    assert not set(block_keys(ids, BT, tenant_root("acme"))) & \
        set(block_keys(ids, BT, tenant_root("acme/session-1")))


def test_a_block_key_depends_on_every_earlier_token():
    a = list(range(12))
    b = a.copy()
    b[0] = 99                      # change in block 0: every key changes
    c = a.copy()
    c[9] = 99                      # change in block 2: blocks 0 and 1 keep their keys
    ka, kb, kc = (block_keys(x, BT) for x in (a, b, c))
    assert all(x != y for x, y in zip(ka, kb))
    assert ka[:2] == kc[:2] and ka[2] != kc[2]


def test_only_full_blocks_are_keyed():
    assert len(block_keys(list(range(11)), BT)) == 2
    assert block_keys([1, 2, 3], BT) == []
