"""The store bounded and indexed: LRU core, ledger, index, evictor, capacity guard, and a
killed evictor's successor (storage/lru.py, ledger.py, index.py, evictor.py)."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from dualpath.errors import ConfigError
from dualpath.kv.prefix import block_keys, key_tag, tenant_root, tenant_tag
from dualpath.kv.profiles import get_profile
from dualpath.kv.synth import SyntheticKV
from dualpath.storage import BlockStore, StorageError
from dualpath.storage.config import StorageConfig
from dualpath.storage.evictor import StoreCapacity
from dualpath.storage.format import HEADER_BYTES
from dualpath.storage.ledger import (
    EVICTED,
    HIT,
    RECORD,
    WROTE,
    LedgerTail,
    LedgerWriter,
)
from dualpath.storage.lru import LruCore, Quotas
from dualpath.storage.store import aligned_bytes

PROFILE = get_profile("demo", 4)            # 64 KiB blocks
KEYS = block_keys(list(range(4 * 40)), 4)   # 40 chained keys
ON_DISK = HEADER_BYTES + 65536


# --- the pure core -----------------------------------------------------------------
def test_lru_evicts_least_recent_down_to_the_low_watermark():
    core = LruCore(1000, high=0.9, low=0.5, lease_s=10)
    for i, k in enumerate([b"a", b"b", b"c", b"d"]):
        core.wrote(k, 200, now=i)
    assert core.victims(now=5) == []                 # 800 <= 900
    core.hit(b"a", now=6)                            # a: most recent, leased until 16
    core.wrote(b"e", 200, now=7)                     # 1000 > 900
    assert core.victims(now=20) == [(b"b", 200), (b"c", 200), (b"d", 200)]
    assert core.usage == 400 and b"a" in core and b"e" in core


def test_a_leased_block_is_skipped_until_its_lease_ends():
    core = LruCore(1000, high=0.5, low=0.1, lease_s=10)
    core.wrote(b"a", 300, now=0)
    core.wrote(b"b", 300, now=1)
    core.hit(b"a", now=2)
    core.hit(b"b", now=3)                           # both leased: a until 12, b until 13
    assert core.victims(now=5) == []
    assert core.victims(now=12.5) == [(b"a", 300)]   # a's lease over, b's not
    assert core.usage == 300


def test_lru_hit_age_and_unknown_keys():
    core = LruCore(100)
    core.wrote(b"a", 10, now=100)
    assert core.hit(b"a", now=130) == 30
    assert core.hit(b"zz", now=130) is None
    assert core.removed(b"zz") == 0 and core.removed(b"a") == 10 and core.usage == 0
    with pytest.raises(ValueError):
        LruCore(100, high=0.5, low=0.8)


# --- the ledger --------------------------------------------------------------------
def test_ledger_round_trip_and_a_torn_tail_is_not_read(tmp_path):
    w = LedgerWriter(tmp_path, sync=False)
    tail = LedgerTail.of(tmp_path, "log", "hits")
    w.wrote(KEYS[0], 123)
    w.hit([KEYS[1], KEYS[2]])
    w.evicted([KEYS[3]])
    assert tail.poll() == []                          # buffered until a flush
    w.flush()
    got = {name.rsplit(".", 1)[-1]: recs for name, recs in tail.poll()}
    assert got == {"log": [(WROTE, 123, KEYS[0]), (EVICTED, 0, KEYS[3])],
                   "hits": [(HIT, 0, KEYS[1]), (HIT, 0, KEYS[2])]}
    # A writer killed mid-record: the partial record is never handed out.
    with open(os.path.join(w.dir, w.name("log")), "ab") as f:
        f.write(RECORD.pack(WROTE, 9, KEYS[4])[:10])
    assert tail.poll() == []
    w.close()
    w.close()                                          # idempotent


def test_ledger_segments_roll_over_and_old_ones_are_pruned(tmp_path):
    w = LedgerWriter(tmp_path, sync=False, segment_bytes=3 * RECORD.size)
    for k in KEYS[:7]:
        w.wrote(k, 1)
        w.flush()
    names = sorted(os.listdir(w.dir))
    assert len(names) == 3                            # 3 + 3 + 1 records
    tail = LedgerTail.of(tmp_path, "log")
    assert sum(len(r) for _, r in tail.poll()) == 7
    for n in names:
        os.utime(os.path.join(w.dir, n), (0, 0))
    assert tail.prune(3600, time.time(), keep=w.own()) == 2
    assert os.listdir(w.dir) == [w.name("log")]
    assert w.unaccounted({w.name("log"): 1 << 40}) == 0   # all read by an evictor
    w.close()


# --- the index ---------------------------------------------------------------------
def _fill(store, key):
    buf = aligned_bytes(store.layout.full_bytes)
    SyntheticKV(store.layout).fill_full(buf, key)
    return buf


def test_a_lookup_of_an_indexed_prefix_costs_no_stat_per_block(tmp_path):
    with BlockStore(tmp_path, PROFILE, read_workers=1) as a, \
            BlockStore(tmp_path, PROFILE, read_workers=1) as b:
        for k in KEYS[:20]:
            a.write(k, _fill(a, k))
        assert a.leading(KEYS) == 20
        assert a.index.stats["index_stat_calls"] == 1        # the first unknown key only
        assert a.leading(KEYS) == 20
        assert a.index.stats["index_stat_calls"] == 2
        # b learns the keys by stat once, then from memory.
        assert b.leading(KEYS[:20]) == 20
        calls = b.index.stats["index_stat_calls"]
        assert calls == 20
        assert b.leading(KEYS[:20]) == 20 and b.index.stats["index_stat_calls"] == calls
        # a deletes block 5: b's index hears it from the ledger (E) at its next refresh.
        assert a.delete(KEYS[5])
        assert a.leading(KEYS) == 5
        b.index.refresh(force=True)
        assert b.leading(KEYS) == 5


def test_a_stale_index_entry_is_a_miss_at_the_read_and_then_forgotten(tmp_path):
    with BlockStore(tmp_path, PROFILE, read_workers=1, index_max_keys=100) as s:
        s.write(KEYS[0], _fill(s, KEYS[0]))
        assert s.leading(KEYS[:1]) == 1
        s.path_of(KEYS[0]).unlink()                   # gone behind the index's back
        assert s.leading(KEYS[:1]) == 1               # advisory: still a hit here
        assert not s.read_into(KEYS[0], aligned_bytes(s.layout.full_bytes))
        assert s.leading(KEYS[:1]) == 0               # the miss dropped it


def test_a_lookup_never_polls_the_ledger_its_own_thread_does(tmp_path):
    # A lookup answers on an event loop (a vLLM engine's Lookup, a node's plan): the
    # ledger's I/O (a stat per writer's file, reads) happened there once a second.
    import threading
    with BlockStore(tmp_path, PROFILE, read_workers=1, fsync=False) as a, \
            BlockStore(tmp_path, PROFILE, read_workers=1, fsync=False) as b:
        for k in KEYS[:4]:
            a.write(k, _fill(a, k))
        assert b.leading(KEYS[:4]) == 4               # learnt by stat, then known
        pollers = []
        real = b.index._tail.poll

        def poll():
            pollers.append(threading.current_thread().name)
            return real()
        b.index._tail.poll = poll
        a.delete(KEYS[1])                              # an E record in a's ledger
        deadline = time.monotonic() + 30               # liveness bound, not a timing
        while b.leading(KEYS[:4]) != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert b.leading(KEYS[:4]) == 1               # heard of within a poll or two
        assert pollers and set(pollers) == {"dp-store-index"}


def test_the_index_starts_over_past_its_bound(tmp_path):
    with BlockStore(tmp_path, PROFILE, read_workers=1, index_max_keys=5) as s:
        for k in KEYS[:8]:
            s.write(k, _fill(s, k))
        assert len(s.index) <= 5 and s.index.stats["index_resets"] == 1
        assert s.leading(KEYS[:8]) == 8               # still right: stat what it lost


# --- the evictor -------------------------------------------------------------------
def _capped(tmp_path, blocks: float, **kw) -> BlockStore:
    cap = StoreCapacity(int(blocks * ON_DISK), high=kw.pop("high", 0.9),
                        low=kw.pop("low", 0.6), lease_s=kw.pop("lease_s", 0.0),
                        interval_s=3600.0,          # ticks by hand: no timing in tests
                        quotas=kw.pop("quotas", Quotas()),
                        namespace_quota=kw.pop("namespace_quota", 0))
    return BlockStore(tmp_path, PROFILE, read_workers=1, fsync=False, capacity=cap, **kw)


def _usage(store) -> int:
    return sum(b.nbytes for b in store.walk())


def _put(store, key, *ticking):
    """Write ``key``, then a round of each store's upkeep (one write per round: what a
    writer adds per round is what the evictor keeps free for it)."""
    store.write(key, _fill(store, key))
    for s in ticking:
        s.upkeep.tick()


def test_one_evictor_keeps_a_shared_store_under_its_bound_least_recent_first(tmp_path):
    with _capped(tmp_path, 40) as a, _capped(tmp_path, 40) as b:
        a.upkeep.tick()
        b.upkeep.tick()
        assert a.upkeep.holds != b.upkeep.holds       # one evictor for the namespace
        ev, other = (a, b) if a.upkeep.holds else (b, a)
        for k in KEYS[:20]:
            _put(ev, k, other, ev)
        for k in KEYS[20:30]:
            _put(other, k, other, ev)
        assert other.leading(KEYS[:1]) == 1          # a lookup's hit
        other.upkeep.tick()                           # flushes other's ledger
        ev.upkeep.tick()
        # 30 blocks; 3 writers (2 active and 1 that may start) x 1 block x 2 reserved:
        # 30 + 6 = 36 = 0.9 x 40, not over.
        assert ev.upkeep.stats.evictions == 0 and ev.upkeep.reserve(time.time()) == 6 * ON_DISK
        _put(other, KEYS[30], other, ev)              # over: down to 0.6 x 40 = 24
        assert ev.upkeep.stats.evictions == 7
        kept = {b.key for b in ev.walk()}
        assert KEYS[0] in kept                        # hit since: the most recent
        assert not kept & set(KEYS[1:8])              # the least recent went
        assert KEYS[8] in kept
        assert _usage(ev) == 24 * ON_DISK == ev.upkeep.core.usage
        assert a.stats.writes_refused_capacity == b.stats.writes_refused_capacity == 0
        # Both processes' lookups stop at the first evicted block.
        other.index.refresh(force=True)
        assert other.leading(KEYS) == 1 and ev.leading(KEYS) == 1


def test_a_write_past_the_bound_is_refused_not_written(tmp_path):
    with _capped(tmp_path, 4, high=1.0, low=1.0, lease_s=3600) as s:
        s.upkeep.tick()
        _put(s, KEYS[0])
        _put(s, KEYS[1])
        assert s.leading(KEYS[:2]) == 2               # leased: the evictor may not help
        s.upkeep.tick()      # publishes 2 blocks, 2 writers (this one, and one may start)
        s.write(KEYS[2], _fill(s, KEYS[2]))           # 2 + 2 x 1 <= 4
        with pytest.raises(StorageError) as e:        # 2 + 2 x (1 unaccounted + 1) > 4
            s.write(KEYS[3], _fill(s, KEYS[3]))
        assert e.value.errno == 28 and "storage.capacity_gib" in str(e.value)
        assert "filesystem" not in str(e.value)       # not the disk-full hint
        assert s.stats.writes_refused_capacity == 1
        assert not s.path_of(KEYS[3]).exists() and _usage(s) <= 4 * ON_DISK


def test_a_lookups_lease_keeps_its_blocks_from_the_evictor(tmp_path):
    with _capped(tmp_path, 6, high=0.5, low=0.25, lease_s=3600) as s:
        s.upkeep.tick()
        for k in KEYS[:3]:
            s.write(k, _fill(s, k))
        assert s.leading(KEYS[:2]) == 2               # a request's plan names 0 and 1
        s.upkeep.tick()
        assert {b.key for b in s.walk()} == set(KEYS[:2])   # 2 only: not leased


def test_a_killed_evictor_is_replaced_by_the_next_tick(tmp_path):
    code = textwrap.dedent(f"""
        import sys, time
        from dualpath.kv.profiles import get_profile
        from dualpath.storage import BlockStore
        from dualpath.storage.evictor import StoreCapacity
        s = BlockStore({str(tmp_path)!r}, get_profile("demo", 4), read_workers=1,
                       capacity=StoreCapacity(1 << 30, interval_s=3600.0))
        s.upkeep.tick()
        print("holds" if s.upkeep.holds else "not", flush=True)
        time.sleep(600)
    """)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "holds"
        with _capped(tmp_path, 10) as s:
            s.write(KEYS[0], _fill(s, KEYS[0]))
            s.upkeep.tick()
            assert not s.upkeep.holds                 # the child holds the lock
            child.send_signal(signal.SIGKILL)
            child.wait(30)
            s.upkeep.tick()
            assert s.upkeep.holds and s.upkeep.stats.takeovers == 1
            assert s.upkeep.core.usage == ON_DISK     # its scan found the block
    finally:
        child.kill()
        child.wait()


def test_config_watermarks_are_checked_and_reach_the_store(tmp_path):
    with pytest.raises(ConfigError, match="low_watermark"):
        StorageConfig(high_watermark=0.5, low_watermark=0.7)
    cfg = StorageConfig(dir=str(tmp_path), capacity_gib=0.5, high_watermark=0.7,
                        low_watermark=0.3, fsync=False)
    with cfg.open_store(PROFILE) as s:
        core = s.upkeep.core
        assert (core.capacity, core.high, core.low) == (1 << 29, 0.7, 0.3)
    with StorageConfig(dir=str(tmp_path), index_max_keys=0).open_store(PROFILE) as s:
        assert s.index is None and s.upkeep is None


def test_the_upkeep_survives_its_ledger_directory_vanishing(tmp_path):
    import shutil
    with _capped(tmp_path, 10) as s:
        s.upkeep.tick()
        shutil.rmtree(s.dir / ".ledger")              # an operator's rm, a scrub gone wrong
        shutil.rmtree(tmp_path / ".evictor")
        _put(s, KEYS[0], s)                           # the next round makes them again
        s.upkeep.tick()
        assert s.upkeep.holds and s.upkeep.core.usage >= 0
        assert (tmp_path / ".evictor" / "usage.json").exists()
        assert any((s.dir / ".ledger").glob("*.log"))


def test_a_read_miss_drops_the_key_from_other_indexes_but_not_from_the_usage(tmp_path):
    with _capped(tmp_path, 40) as ev, BlockStore(tmp_path, PROFILE, read_workers=1) as b:
        ev.upkeep.tick()
        _put(ev, KEYS[0], ev)
        assert b.leading(KEYS[:1]) == 1 and ev.leading(KEYS[:1]) == 1
        os.rename(ev.path_of(KEYS[0]), str(ev.path_of(KEYS[0])) + ".away")   # out of sight
        assert not b.read_into(KEYS[0], aligned_bytes(b.layout.full_bytes))  # M, flushed
        ev.index.refresh(force=True)
        assert KEYS[0] not in ev.index._keys          # the other index dropped it too
        ev.upkeep.tick()
        assert ev.upkeep.core.usage == ON_DISK        # maybe only out of one client's sight


def test_equal_watermarks_never_empty_the_store(tmp_path):
    with _capped(tmp_path, 10, high=0.5, low=0.5) as s:
        s.upkeep.tick()
        for k in KEYS[:3]:
            _put(s, k, s)
        assert len(list(s.walk())) >= 2


def test_a_live_writers_idle_hit_file_is_never_pruned(tmp_path):
    with _capped(tmp_path, 40) as ev, _capped(tmp_path, 40) as other:
        ev.upkeep.tick()
        assert ev.upkeep.holds
        other.lease(KEYS[:1])
        other.upkeep.tick()                           # its .log and .hits exist, alive
        hits = ev.dir / ".ledger" / other.ledger.name("hits")
        os.utime(hits, (0, 0))                        # no hit for a very long time
        ev.upkeep._next_prune = 0.0
        ev.upkeep.tick()
        assert hits.exists()


# --- tenant quotas -----------------------------------------------------------------
ACME = block_keys(list(range(4 * 20)), 4, tenant_root("acme"))
ACME_S = block_keys(list(range(4 * 20)), 4, tenant_root("acme/session-7"))
BETA = block_keys(list(range(4 * 20)), 4, tenant_root("beta"))


def test_lru_evicts_an_account_over_its_quota_from_its_own_blocks_first():
    a, b = tenant_tag("acme"), tenant_tag("beta")
    core = LruCore(10_000, high=0.9, low=0.5, quotas=Quotas(0, {a: 1000}))
    for i, k in enumerate(BETA[:5]):              # beta's blocks are the least recent
        core.wrote(k, 200, now=i)
    for i, k in enumerate(ACME[:4] + ACME_S[:2]):  # acme: 1200 > 0.9 x 1000
        core.wrote(k, 200, now=10 + i)
    assert core.tenant_usage == {b: 1000, a: 1200}
    core.hit(ACME[0], now=20)                      # acme's most recent now (leased 60 s)
    got = core.victims(now=21)
    # Down to 0.5 x 1000: its own least recent, the salted session's blocks included;
    # beta (no quota, older blocks) untouched: the store is far under its bound.
    assert got == [(ACME[1], 200), (ACME[2], 200), (ACME[3], 200), (ACME_S[0], 200)]
    assert core.tenant_usage == {b: 1000, a: 400} and core.usage == 1400
    assert core.victims(now=22) == []


def test_the_evictor_keeps_a_tenant_under_its_quota_and_refuses_writes_past_it(tmp_path):
    acme, beta = tenant_tag("acme"), tenant_tag("beta")
    quotas = Quotas(0, {acme: 5 * ON_DISK})
    with _capped(tmp_path, 100, high=1.0, low=0.5, quotas=quotas) as s:
        # Written before any evictor ran: acme (and its salted session) 7 blocks.
        for k in ACME[:4] + ACME_S[:3] + BETA[:8]:
            s.write(k, _fill(s, k))
        # Takes over, scans: acme 7 blocks + a reserve of a block for each of 2 writers
        # (this one, one that may start) > 5: down to 2.5 at most, its own blocks only.
        s.upkeep.tick()
        assert s.upkeep.core.tenant_usage == {acme: 2 * ON_DISK, beta: 8 * ON_DISK}
        assert sum(b.nbytes for b in s.walk() if key_tag(b.key) == acme) == 2 * ON_DISK
        assert all(s.path_of(k).exists() for k in BETA[:8])
        # Published: acme 2 blocks. A quota is soft between rounds: each writer counts
        # its own writes since the publication.
        for k in ACME[10:13]:
            s.write(k, _fill(s, k))                  # 2 + 3 <= 5
        with pytest.raises(StorageError) as e:       # 2 + 4 > 5
            s.write(ACME[13], _fill(s, ACME[13]))
        assert e.value.errno == 28 and "quota" in str(e.value)
        assert f"{acme:06x}" in str(e.value)
        assert not s.path_of(ACME[13]).exists()
        s.write(BETA[8], _fill(s, BETA[8]))          # beta has no quota: written
        # A tenant at its quota keeps turning over: the next round makes room.
        s.upkeep.tick()
        assert s.upkeep.core.tenant_usage[acme] <= 3 * ON_DISK
        assert all(s.path_of(k).exists() for k in ACME[11:13])   # the newest stay
        s.write(ACME[13], _fill(s, ACME[13]))
        with _capped(tmp_path, 100, quotas=quotas) as other:   # another process
            other.write(ACME_S[10], _fill(other, ACME_S[10]))   # its own share


def test_tenant_quotas_need_a_capacity_and_name_accounts():
    with pytest.raises(ConfigError, match="capacity_gib"):
        StorageConfig(tenant_quota_gib=1.0)
    with pytest.raises(ConfigError, match="account name"):
        StorageConfig(capacity_gib=1.0, tenant_quotas={"acme/x": 1.0})
    cfg = StorageConfig(capacity_gib=1.0, tenant_quota_gib=0.25,
                        tenant_quotas={"acme": 0.5, "": 0.0})
    q = cfg.capacity().quotas
    assert q.of(tenant_tag("acme")) == 2**29 and q.of(tenant_tag("beta")) == 2**28
    assert q.of(0) is None                          # the default tenant: no quota


# --- one bound for the whole store ---------------------------------------------------
PROFILE8 = get_profile("demo", 8)           # another KV format: another namespace
KEYS8 = block_keys(list(range(8 * 20)), 8)
ON_DISK8 = HEADER_BYTES + 2 * 65536


def _capped8(tmp_path, total: int, **kw) -> BlockStore:
    cap = StoreCapacity(total, high=kw.pop("high", 0.9), low=kw.pop("low", 0.6),
                        lease_s=0.0, interval_s=3600.0,
                        namespace_quota=kw.pop("namespace_quota", 0))
    return BlockStore(tmp_path, PROFILE8, read_workers=1, fsync=False, capacity=cap, **kw)


def test_one_evictor_bounds_every_namespace_of_the_store_least_recent_first(tmp_path):
    # Issue 40: capacity_gib bounded each model namespace on its own, so a store shared
    # by two models could hold twice its bound. Now one evictor keeps the whole store.
    total = 40 * ON_DISK
    with _capped(tmp_path, 40, high=0.9, low=0.5) as a, \
            _capped8(tmp_path, total, high=0.9, low=0.5) as b:
        a.upkeep.tick()
        b.upkeep.tick()
        assert a.upkeep.holds != b.upkeep.holds      # one evictor for both namespaces
        for k in KEYS[:8]:                           # namespace demo-t4: the oldest
            _put(a, k, a, b)
        for k in KEYS8[:4]:                          # demo-t8: 4 x 2 blocks' bytes
            _put(b, k, b, a)
        assert a.leading(KEYS[:2]) == 2              # hit: demo-t4's 0, 1 most recent
        a.upkeep.tick()
        b.upkeep.tick()
        # Usage plus the writers' reserve (3 writers x 2 x the largest block) passes
        # 0.9 x the store's bound at the 5th more block of demo-t8: down to 0.5 x it.
        ev = a if a.upkeep.holds else b
        for k in KEYS8[4:9]:
            _put(b, k, b, a)
        assert ev.upkeep.stats.evictions == 6
        on_disk = sum(x.nbytes for s in (a, b) for x in s.walk())
        assert on_disk <= 0.5 * total and on_disk == ev.upkeep.core.usage
        kept4 = {x.key for x in a.walk()}
        assert kept4 == set(KEYS[:2])                # hit since: kept; the store's least
        assert {x.key for x in b.walk()} == set(KEYS8[:9])   # recent went, not the newer
        # The other namespace's processes hear of it through their own ledger.
        a.index.refresh(force=True)
        assert a.leading(KEYS[:8]) == 2
        pub = json.loads((tmp_path / ".evictor" / "usage.json").read_text())
        assert pub["namespaces"] == {"demo-t4": 2 * ON_DISK, "demo-t8": 9 * ON_DISK8}


def test_a_namespace_over_its_quota_loses_its_own_blocks_first(tmp_path):
    quota = 4 * ON_DISK8
    # Every process of the store has the same [storage] (the evictor's rules).
    with _capped(tmp_path, 100, high=1.0, low=0.5, namespace_quota=quota) as a, \
            _capped8(tmp_path, 100 * ON_DISK, high=1.0, low=0.5,
                     namespace_quota=quota) as b:
        t0 = time.time() - 100
        for i, k in enumerate(KEYS[:3]):
            a.write(k, _fill(a, k))                  # demo-t4: older, no quota pressure
            os.utime(a.path_of(k), (t0 + i, t0 + i))
        for i, k in enumerate(KEYS8[:6]):
            b.write(k, _fill(b, k))                  # demo-t8: 6 > 4 blocks
            os.utime(b.path_of(k), (t0 + 10 + i, t0 + 10 + i))
        b.upkeep.tick()                              # takes over: scans both (mtimes)
        a.upkeep.tick()
        assert {x.key for x in a.walk()} == set(KEYS[:3])
        assert {x.key for x in b.walk()} == set(KEYS8[4:6])     # down to 0.5 x quota
        b.write(KEYS8[6], _fill(b, KEYS8[6]))        # 2 + 1 <= 4 blocks
        b.write(KEYS8[7], _fill(b, KEYS8[7]))        # 2 + 2
        with pytest.raises(StorageError, match="namespace demo-t8 is at its quota"):
            b.write(KEYS8[8], _fill(b, KEYS8[8]))    # 2 + 3 > 4
        a.write(KEYS[4], _fill(a, KEYS[4]))   # the other namespace still writes


def test_zero_byte_blocks_and_their_groups_are_counted_by_blocks():
    # A review found: a group's entry went when its bytes reached 0, so a second
    # 0-byte block of it (a file cut short by a crash with fsync off) raised KeyError.
    core = LruCore(1000, high=0.5, low=0.1, quotas=Quotas(0, {tenant_tag("acme"): 100}))
    for k in ACME[:3]:
        core.wrote(k, 0, now=0)
    core.wrote(BETA[0], 600, now=1)
    assert core.removed(ACME[0]) == 0 and core.tenant_usage[tenant_tag("acme")] == 0
    assert [k for k, _ in core.victims(now=2)] == [ACME[1], ACME[2], BETA[0]]
    assert core.usage == 0 and core.tenant_usage == {}


def test_a_namespace_that_cannot_be_scanned_does_not_stop_the_stores_eviction(
        tmp_path, monkeypatch):
    from dualpath.storage import evictor as ev_mod
    real = ev_mod.walk_blocks

    def walk(path):
        if os.path.basename(path) == "demo-t8":
            raise PermissionError(13, "Permission denied", path)
        return real(path)
    with _capped8(tmp_path, 10 * ON_DISK) as b:
        for k in KEYS8[:2]:
            b.write(k, _fill(b, k))
    monkeypatch.setattr(ev_mod, "walk_blocks", walk)
    monkeypatch.setattr(ev_mod, "DISCOVER_S", 0.0)     # look for namespaces every tick
    with _capped(tmp_path, 10, high=0.9, low=0.5) as a:
        for k in KEYS[:9]:
            a.write(k, _fill(a, k))
        a.upkeep.tick()                 # demo-t8 cannot be scanned: left out, not fatal
        assert a.upkeep.holds and a.upkeep.stats.evictions > 0
        assert (tmp_path / ".evictor" / "usage.json").exists()
        assert sum(x.nbytes for x in a.walk()) <= 5 * ON_DISK
        monkeypatch.setattr(ev_mod, "walk_blocks", real)
        a.upkeep.tick()                 # readable again: scanned, counted
        assert json.loads((tmp_path / ".evictor" / "usage.json").read_text())[
            "namespaces"]["demo-t8"] == 2 * ON_DISK8


def test_a_removed_namespace_is_forgotten_and_never_made_again(tmp_path):
    import shutil
    with _capped(tmp_path, 10, high=0.9, low=0.5) as a:
        with _capped8(tmp_path, 10 * ON_DISK) as b:
            for k in KEYS8[:3]:
                b.write(k, _fill(b, k))
        a.upkeep.tick()
        t8 = a.upkeep._spaces["demo-t8"].prefix
        assert a.upkeep.core.space_usage[t8] == sum(x.nbytes for x in b.walk()) > 0
        shutil.rmtree(tmp_path / "demo-t8")          # the operator drops a model
        for k in KEYS[:12]:                          # and the store fills: evictions
            _put(a, k, a)
        assert a.upkeep.stats.evictions > 0 and not (tmp_path / "demo-t8").exists()
        assert a.upkeep.core.usage == sum(x.nbytes for x in a.walk())
        assert t8 not in a.upkeep.core.space_usage


def test_a_namespace_written_without_a_capacity_is_rescanned(tmp_path, monkeypatch):
    from dualpath.storage import evictor as ev_mod
    monkeypatch.setattr(ev_mod, "RESCAN_S", 0.0)
    monkeypatch.setattr(ev_mod, "DISCOVER_S", 0.0)
    with _capped(tmp_path, 100) as a:
        a.upkeep.tick()
        with BlockStore(tmp_path, PROFILE8, read_workers=1, fsync=False) as plain:
            for k in KEYS8[:3]:                      # no W records: never heard of
                plain.write(k, _fill(plain, k))
        a.upkeep.tick()                              # found at its next rescan
        assert a.upkeep.core.space_usage[a.upkeep._spaces["demo-t8"].prefix] == \
            3 * ON_DISK8


def test_a_block_the_evictor_cannot_reach_stays_counted(tmp_path, monkeypatch):
    # A review found: an EACCES or EIO opening another namespace's fan-out directory
    # read as "not there", so the evictor forgot a block still on disk (usage under-
    # counted, the bound slipping) with no warning.
    real = os.open
    with _capped8(tmp_path, 10 * ON_DISK) as b:
        t0 = time.time() - 100
        for i, k in enumerate(KEYS8[:4]):           # demo-t8's blocks: the oldest
            b.write(k, _fill(b, k))
            os.utime(b.path_of(k), (t0 + i, t0 + i))
    with _capped(tmp_path, 10, high=0.9, low=0.5) as a:
        def denied(path, flags, *args, **kw):      # demo-t8's fan-out: EACCES
            if isinstance(path, str) and "/demo-t8/" in path and flags & os.O_DIRECTORY:
                raise PermissionError(13, "Permission denied", path)
            return real(path, flags, *args, **kw)
        monkeypatch.setattr(os, "open", denied)
        a.upkeep.tick()                  # over: picks demo-t8's, cannot remove them
        monkeypatch.setattr(os, "open", real)
        assert a.upkeep.stats.evictions == 0
        assert a.upkeep.core.usage == sum(x.nbytes for x in b.walk()) == 4 * ON_DISK8
        a.upkeep.tick()                  # reachable again: evicted and uncounted
        assert a.upkeep.stats.evictions > 0
        assert a.upkeep.core.usage == sum(x.nbytes for x in b.walk())
