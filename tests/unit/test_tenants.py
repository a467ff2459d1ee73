"""Tenants: the root of a request's block keys, so one tenant's stored KV is never
another's hit (kv/prefix.py tenant_root; the payload, the connector, the front end)."""

from types import SimpleNamespace

import numpy as np
import pytest

from dualpath.errors import UsageError
from dualpath.frontend import protocol as api
from dualpath.frontend.index import HitIndex
from dualpath.kv.prefix import ROOT_KEY, block_keys, tenant_root
from dualpath.paths.kvplan import block_spans
from dualpath.paths.payload import Payload
from dualpath.vllm.scheduler_side import key_root

IDS = list(range(1000, 1000 + 4096))        # the same 4K-token prefix for every tenant


def test_each_tenant_roots_its_own_chain_and_the_default_keeps_the_old_root():
    a, b = tenant_root("acme"), tenant_root("globex")
    assert tenant_root("") == ROOT_KEY and a != b and ROOT_KEY not in (a, b)
    ka, kb, kd = (set(block_keys(IDS, 64, r)) for r in (a, b, ROOT_KEY))
    assert not ka & kb and not ka & kd and len(ka) == 64
    assert block_keys(IDS, 64, a) == block_keys(IDS, 64, tenant_root("acme"))   # stable
    spans = block_spans(np.array(IDS), 64, a)
    assert [s.key for s in spans] == block_keys(IDS, 64, a)
    with pytest.raises(UsageError, match="256"):
        tenant_root("x" * 257)


def test_the_payload_carries_a_bounded_tenant():
    p = Payload("t", 0, 100, 0, 1, tenant="acme")
    assert Payload.decode(p.encode()).key_root == tenant_root("acme")
    assert Payload("t", 0, 100, 0, 1).key_root == ROOT_KEY
    with pytest.raises(UsageError, match="tenant"):
        Payload("t", 0, 100, 0, 1, tenant="x" * 300)


def _vllm_request(salt=None, params=None):
    return SimpleNamespace(cache_salt=salt, kv_transfer_params=params)


def test_the_connector_roots_keys_at_the_nodes_tenant_else_vllms_salt():
    assert key_root(_vllm_request()) == ROOT_KEY
    assert key_root(_vllm_request("acme")) == tenant_root("acme")
    # P/D: the node names the tenant (its payload's), whatever salt the instance got
    # (bench/vllm_pd.py salts every request to keep vLLM's own cache out of the way).
    pd = {"dualpath": {"request_id": "r", "ticket": "t", "tenant": ""}}
    assert key_root(_vllm_request("per-request-salt", pd)) == ROOT_KEY
    pd["dualpath"]["tenant"] = "globex"
    assert key_root(_vllm_request("acme", pd)) == tenant_root("globex")
    # A salt longer than a tenant name still gets a root of its own, never the default.
    assert key_root(_vllm_request("s" * 1000)) not in (ROOT_KEY, tenant_root(""))


def test_the_front_ends_hit_index_is_per_tenant():
    idx = HitIndex(64, 10_000)
    idx.remember(IDS, [1, 2, 3], tenant_root("acme"))
    assert idx.hit_tokens(IDS, tenant_root("acme")) == 4096 - 64   # never the last block
    assert idx.hit_tokens(IDS, tenant_root("globex")) == 0
    assert idx.hit_tokens(IDS) == 0


@pytest.mark.parametrize("salt", [5, "", "x" * 257])
def test_the_front_end_refuses_a_bad_cache_salt_naming_it(salt):
    limits = SimpleNamespace(model="m", max_tokens=100, max_prompt_tokens=10_000,
                             context_tokens=10_000)
    with pytest.raises(api.ApiError) as e:
        api.parse_completion({"model": "m", "prompt": [1, 2], "cache_salt": salt}, limits)
    assert e.value.status == 400 and "cache_salt" in str(e.value)


def test_the_front_end_takes_cache_salt_as_the_tenant():
    limits = SimpleNamespace(model="m", max_tokens=100, max_prompt_tokens=10_000,
                             context_tokens=10_000)
    call = api.parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                           "cache_salt": "acme"}, limits)
    assert call.cache_salt == "acme"
