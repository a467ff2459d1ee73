"""Stored KV that cannot be forged or redirected by a writer of the shared mount:
keyed integrity tags (a block planted without the cluster key is a miss, however valid
its XXH3 hashes), block paths that never leave the store root (symlinks refused, never
followed, for reads and writes), and a directory, FIFO or device in place of a block is
a miss that says nothing about O_DIRECT support."""

import os
import shutil

import pytest

from dualpath import config
from dualpath.errors import ConfigError
from dualpath.kv.prefix import block_keys
from dualpath.kv.profiles import get_profile
from dualpath.kv.synth import SyntheticKV
from dualpath.storage import BlockStore
from dualpath.storage.store import aligned_bytes
from tests.unit.test_storage_store import _put, _read, both_paths  # noqa: F401 - a fixture

pytestmark = pytest.mark.usefixtures("both_paths")   # both read paths face each attack

PROFILE = get_profile("demo", 4)   # 64 KiB blocks
KEYS = block_keys(list(range(32)), 4)
SECRET = bytes(range(32))


def test_a_block_planted_without_the_cluster_key_is_a_miss(tmp_path):
    # The attacker writes the shared mount with the same code but no key (or another
    # key): every XXH3 hash in the file is valid, the KV is the attacker's.
    with BlockStore(tmp_path, PROFILE, integrity_key=SECRET) as good, \
            BlockStore(tmp_path, PROFILE) as forger, \
            BlockStore(tmp_path, PROFILE, integrity_key=bytes(32)) as other_key:
        _put(good, KEYS[0])
        ok, out = _read(good, KEYS[0])
        assert ok and SyntheticKV(good.layout).verify_full(out, KEYS[0]) is None
        _put(forger, KEYS[1], fill=KEYS[2])        # untagged
        _put(other_key, KEYS[3], fill=KEYS[4])     # tagged with the wrong key
        for k in (KEYS[1], KEYS[3]):
            assert _read(good, k)[0] is False
        assert good.stats.corrupt_blocks == 2 and good.stats.hits == 1
        # Overwriting a good block in place with a forged one is caught the same way.
        _put(forger, KEYS[5])
        forger.write(KEYS[0], aligned_bytes(good.layout.full_bytes), overwrite=True)
        assert _read(good, KEYS[0])[0] is False



def _reseal(data: bytearray, payload_len: int) -> None:
    """Re-seal a block file's XXH3 payload hash and header hash after an edit (what a
    writer of the mount can do without the key)."""
    import struct

    import xxhash

    from dualpath.storage.format import HEADER_BYTES
    struct.pack_into("<Q", data, 72, xxhash.xxh3_64_intdigest(
        bytes(data[HEADER_BYTES:HEADER_BYTES + payload_len])))
    struct.pack_into("<Q", data, 96, xxhash.xxh3_64_intdigest(bytes(data[:96])))


def test_a_genuine_header_spliced_onto_other_kv_is_a_miss(tmp_path):
    # The attacker keeps a genuine block's header (its nonce and tag) and swaps in other
    # KV, or moves one block's nonce and tag onto another: the one-time key of a nonce
    # authenticates only the write that drew it.
    from dualpath.storage.format import HEADER_BYTES, NONCE_OFFSET, TAG_BYTES, TAG_OFFSET
    with BlockStore(tmp_path, PROFILE, integrity_key=SECRET) as good:
        n = good.layout.full_bytes
        for k in KEYS[:3]:
            _put(good, k)
        a, b = (bytearray(good.path_of(k).read_bytes()) for k in KEYS[:2])
        c = bytearray(good.path_of(KEYS[2]).read_bytes())
        a[HEADER_BYTES:] = b[HEADER_BYTES:]                  # KEYS[1]'s KV, KEYS[0]'s tag
        _reseal(a, n)
        good.path_of(KEYS[0]).write_bytes(bytes(a))
        c[NONCE_OFFSET:TAG_OFFSET + TAG_BYTES] = b[NONCE_OFFSET:TAG_OFFSET + TAG_BYTES]
        good.path_of(KEYS[2]).write_bytes(bytes(c))          # KEYS[1]'s nonce and tag
        assert _read(good, KEYS[0])[0] is False
        assert _read(good, KEYS[2])[0] is False
        assert _read(good, KEYS[1])[0] is True
        assert good.stats.corrupt_blocks == 2



def test_with_a_key_the_tag_alone_catches_a_flipped_byte(tmp_path):
    # Keyed reads check the tag instead of the XXH3 digest (one pass, not two): an
    # accident in the payload must still be caught, on both read paths.
    from dualpath.storage.format import HEADER_BYTES
    with BlockStore(tmp_path, PROFILE, integrity_key=SECRET) as good:
        _put(good, KEYS[0])
        path = good.path_of(KEYS[0])
        data = bytearray(path.read_bytes())
        data[HEADER_BYTES + 12345] ^= 0x01
        path.write_bytes(bytes(data))
        assert _read(good, KEYS[0])[0] is False
        assert good.stats.corrupt_blocks == 1

def test_every_write_draws_its_own_nonce(tmp_path):
    # Poly1305 is a one-time authenticator: two writes of the same block (same key, same
    # KV) must not share a one-time key, so they carry different nonces and tags.
    from dualpath.storage.format import NONCE_OFFSET, TAG_BYTES, TAG_OFFSET
    with BlockStore(tmp_path, PROFILE, integrity_key=SECRET) as good:
        buf = _put(good, KEYS[0])
        first = good.path_of(KEYS[0]).read_bytes()
        assert good.write(KEYS[0], buf, overwrite=True)
        second = good.path_of(KEYS[0]).read_bytes()
        assert first[NONCE_OFFSET:TAG_OFFSET] != second[NONCE_OFFSET:TAG_OFFSET]
        assert first[TAG_OFFSET:TAG_OFFSET + TAG_BYTES] != second[
            TAG_OFFSET:TAG_OFFSET + TAG_BYTES]
        assert any(first[NONCE_OFFSET:TAG_OFFSET])
        assert _read(good, KEYS[0])[0] is True

def test_block_paths_never_follow_a_symlink_out_of_the_store(tmp_path):
    outside = tmp_path / "outside"
    with BlockStore(outside, PROFILE) as elsewhere:
        _put(elsewhere, KEYS[0])                   # a valid block outside our root
        target = elsewhere.path_of(KEYS[0])
    root = tmp_path / "store"
    with BlockStore(root, PROFILE) as s:
        # A symlink in place of the block file.
        p = s.path_of(KEYS[0])
        p.parent.mkdir(parents=True)
        p.symlink_to(target)
        assert _read(s, KEYS[0])[0] is False and not s.contains(KEYS[0])
        # A symlinked fan-out directory: no read through it, and no write lands in it.
        q = s.path_of(KEYS[1])
        q.parent.parent.mkdir(parents=True, exist_ok=True)
        victim = tmp_path / "victim"
        victim.mkdir()
        q.parent.symlink_to(victim)
        shutil.copy(target, victim / q.name)
        assert _read(s, KEYS[1])[0] is False
        with pytest.raises(Exception, match="symlink or a file in the way"):
            _put(s, KEYS[1])
        assert sorted(x.name for x in victim.iterdir()) == [q.name]   # nothing new there
        assert s.stats.unsafe_paths == 2 and s.stats.hits == 0
        assert s.delete(KEYS[1]) is False and (victim / q.name).exists()


def test_a_directory_or_fifo_in_place_of_a_block_is_a_miss_and_o_direct_stays_on(tmp_path):
    with BlockStore(tmp_path, PROFILE, direct_io="auto") as s:
        _put(s, KEYS[0])
        d = s.path_of(KEYS[1])
        d.mkdir(parents=True)                      # a directory named like a block
        f = s.path_of(KEYS[2])
        f.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(f)                               # opening it for reading would block
        direct = s.direct
        assert _read(s, KEYS[1])[0] is False and _read(s, KEYS[2])[0] is False
        assert s.direct == direct                  # not a reason to turn O_DIRECT off
        assert s.stats.unsafe_paths == 2
        assert _read(s, KEYS[0])[0] is True


def test_integrity_key_file_errors_are_config_errors(tmp_path):
    k = tmp_path / "k"
    k.write_bytes(b"short")
    os.chmod(k, 0o600)
    with pytest.raises(ConfigError, match="5 bytes; the key needs at least 32"):
        config.from_dict({"storage": {"integrity_key_file": str(k)}}).storage.integrity_key()
    k.write_bytes(SECRET)
    os.chmod(k, 0o644)
    with pytest.raises(ConfigError, match="readable by every user"):
        config.from_dict({"storage": {"integrity_key_file": str(k)}}).storage.integrity_key()
    os.chmod(k, 0o600)
    assert config.from_dict({"storage": {"integrity_key_file": str(k)}}).storage \
        .integrity_key() == SECRET
