"""The block-backend protocol (storage/backend.py) and its POSIX implementation: the store
has every member the protocol names, and walk() lists exactly the stored blocks, never
following a link out of the store."""

import os

import pytest

from dualpath.kv.layout import BlockLayout
from dualpath.kv.prefix import block_keys
from dualpath.kv.profiles import get_profile
from dualpath.kv.synth import SyntheticKV
from dualpath.storage import BlockStore
from dualpath.storage.backend import BlockBackend
from dualpath.storage.store import aligned_bytes

PROFILE = get_profile("demo", 4)
KEYS = block_keys(list(range(24)), 4)


@pytest.fixture
def store(tmp_path):
    with BlockStore(tmp_path / "store", PROFILE, read_workers=2) as s:
        yield s


def _put(store, key):
    buf = aligned_bytes(BlockLayout.of(PROFILE).full_bytes)
    SyntheticKV(store.layout).fill_full(buf, key)
    assert store.write(key, buf)


def test_the_store_has_every_member_of_the_protocol(store):
    names = {n for n in vars(BlockBackend) if not n.startswith("_")}
    names |= set(BlockBackend.__annotations__)
    assert {n for n in names if not hasattr(store, n)} == set()


def test_walk_lists_the_stored_blocks_and_nothing_else(store, tmp_path):
    for k in KEYS[:4]:
        _put(store, k)
    assert store.delete(KEYS[3])
    # Things in the store's tree that are not its blocks: a temp file, a quarantined
    # block, a stray name, and a symlinked fan-out directory pointing outside holding
    # a block-named file.
    d = store.path_of(KEYS[0]).parent
    (d / f".{KEYS[0].hex()}.kvb.x1.tmp").write_bytes(b"t")
    (d / f"{KEYS[0].hex()}.kvb.corrupt").write_bytes(b"c")
    (d / "README").write_text("stray")
    fake = KEYS[5].hex()
    outside = tmp_path / "outside" / fake[2:4]
    outside.mkdir(parents=True)
    (outside / f"{fake}.kvb").write_bytes(b"x")
    assert not (store.dir / fake[:2]).exists()
    os.symlink(tmp_path / "outside", store.dir / fake[:2])
    got = {b.key: b for b in store.walk()}
    assert set(got) == set(KEYS[:3])
    assert all(b.nbytes == store.path_of(b.key).stat().st_size and b.mtime > 0
               for b in got.values())


def test_walk_of_an_empty_store_is_empty(store):
    assert list(store.walk()) == []
