"""BlockStore: round trips, corruption handling, O_DIRECT fallback, write errors."""

import asyncio
import dataclasses
import errno
import fcntl
import logging
import os
import struct
import subprocess
import sys

import pytest
import xxhash

from dualpath._native import ffi, lib
from dualpath.errors import DualPathError, UsageError
from dualpath.kv.layout import BlockLayout
from dualpath.kv.prefix import block_keys
from dualpath.kv.profiles import get_profile
from dualpath.kv.synth import SyntheticKV
from dualpath.storage import BlockStore, StorageError
from dualpath.storage.format import HEADER_BYTES, MAGIC
from dualpath.storage.format import VERSION as FORMAT_VERSION
from dualpath.storage.store import aligned_bytes

# demo with 4-token blocks: 8 layers x 4 x 2048 = 64 KiB, a whole number of pages.
# ds660b with 4-token blocks: 61 x 4 x 656 = 160064 bytes, NOT page-sized (tail path).
PROFILES = [get_profile("demo", 4), get_profile("ds660b", 4)]
KEYS = block_keys(list(range(16)), 4)


@pytest.fixture(params=PROFILES, ids=lambda p: p.name)
def store(request, tmp_path):
    with BlockStore(tmp_path, request.param, read_workers=2) as s:
        yield s


def _put(store, key, fill=None):
    """Write block ``key`` holding the synthetic KV of ``fill`` (default: its own)."""
    buf = aligned_bytes(store.layout.full_bytes)
    SyntheticKV(store.layout).fill_full(buf, fill or key)
    assert store.write(key, buf)
    return buf


# The read paths: one block per call (Python, a worker thread's preadv), a batch
# (store_io.c: openat2 beneath the root, io_uring, one ring per call) and the store's
# ring reader (the same C loop on a ring that outlives the call, fed from a thread of
# its own: what the read queue uses). Tests that use the `both_paths` fixture run on
# each.
READERS = {"one": lambda s, k, out: s.read_into(k, out),
           "batch": lambda s, k, out: s.read_batch([k], [out])[0],
           "ring": lambda s, k, out: asyncio.run(s.aread_many([k], [out]))[0]}
_reader = READERS["one"]


@pytest.fixture(params=sorted(READERS))
def both_paths(request, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "_reader", READERS[request.param])
    return request.param


def _read(store, key):
    out = aligned_bytes(store.layout.full_bytes)
    return _reader(store, key, out), out


def test_round_trip_verifies(both_paths, store):
    for k in KEYS:
        _put(store, k)
    synth = SyntheticKV(store.layout)
    for k in KEYS:
        ok, out = _read(store, k)
        assert ok and synth.verify_full(out, k) is None
    assert store.stats.hits == len(KEYS) and store.stats.bounce_reads == 0
    assert store.path_of(KEYS[0]).stat().st_size == HEADER_BYTES + store.layout.full_bytes


def test_unaligned_destination_bounces_and_still_verifies(store):
    _put(store, KEYS[0])
    out = aligned_bytes(store.layout.full_bytes + 8)[8:]     # page-aligned + 8
    assert out.ctypes.data % 4096 == 8
    assert store.read_into(KEYS[0], out)
    assert SyntheticKV(store.layout).verify_full(out, KEYS[0]) is None
    assert store.stats.bounce_reads == (1 if store.direct else 0)


def test_missing_block_is_a_plain_miss(both_paths, store):
    assert not store.contains(KEYS[0])
    ok, _ = _read(store, KEYS[0])
    assert not ok
    assert (store.stats.misses, store.stats.corrupt_blocks) == (1, 0)


def _cached_pages(path) -> int:
    """Pages of ``path`` in the page cache (mincore over a read-only mapping)."""
    import ctypes
    import mmap as _mmap
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = os.path.getsize(path)
    vec = (ctypes.c_ubyte * -(-size // _mmap.PAGESIZE))()
    with open(path, "rb") as f:
        p = libc.mmap(None, size, _mmap.PROT_READ, _mmap.MAP_SHARED, f.fileno(), 0)
        assert p not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        try:
            assert libc.mincore(p, size, vec) == 0, ctypes.get_errno()
        finally:
            libc.munmap(p, size)
    return sum(b & 1 for b in vec)


def test_a_written_block_leaves_the_page_cache(store):
    # Persisted KV is read back with O_DIRECT; its pages must not crowd out the host's
    # fresher data (bounded write-back).
    if subprocess.run(["stat", "-f", "-c", "%T", str(store.dir)], capture_output=True, check=False,
                      text=True).stdout.strip() == "tmpfs":
        pytest.skip("the store is on tmpfs, where the page cache is the storage")
    _put(store, KEYS[0])
    assert _cached_pages(store.path_of(KEYS[0])) == 0
    with open(store.path_of(KEYS[0]), "rb") as f:     # a buffered read caches it ...
        f.read()
    assert _cached_pages(store.path_of(KEYS[0])) > 0  # ... so the probe can see pages


def test_a_block_written_without_fsync_leaves_the_page_cache_too(tmp_path):
    # storage.fsync = false (benches) used to leave every written block cached: DONTNEED
    # cannot drop dirty pages. With O_DIRECT reads the write is now written back (not
    # durable) first, so its pages go.
    with BlockStore(tmp_path, PROFILES[0], fsync=False) as s:
        if subprocess.run(["stat", "-f", "-c", "%T", str(s.dir)], capture_output=True,
                          check=False, text=True).stdout.strip() == "tmpfs":
            pytest.skip("the store is on tmpfs, where the page cache is the storage")
        _put(s, KEYS[0])
        assert s.direct
        assert _cached_pages(s.path_of(KEYS[0])) == 0


def test_write_skips_existing_blocks_unless_overwrite(store):
    buf = _put(store, KEYS[0])
    assert not store.write(KEYS[0], buf)
    assert store.write(KEYS[0], buf, overwrite=True)
    assert (store.stats.writes, store.stats.writes_skipped) == (2, 1)


def test_async_and_parallel_reads(store):
    import asyncio
    for k in KEYS:
        _put(store, k)
    outs = [aligned_bytes(store.layout.full_bytes) for _ in KEYS]
    assert store.read_many(KEYS, outs) == [True] * len(KEYS)
    assert asyncio.run(store.aread(KEYS[1], outs[0]))
    assert SyntheticKV(store.layout).verify_full(outs[0], KEYS[1]) is None


def test_a_batch_reads_every_block_into_its_own_buffer(store):
    # More blocks than the ring's depth (refills), a miss and an unaligned buffer (read
    # alone, through a bounce buffer) among them.
    import asyncio
    keys = block_keys(list(range(64)), 4)
    synth = SyntheticKV(store.layout)
    for k in keys[:12]:
        _put(store, k)
    outs = [aligned_bytes(store.layout.full_bytes) for _ in keys]
    outs[5] = aligned_bytes(store.layout.full_bytes + 1)[1:]
    got = asyncio.run(store.aread_many(keys, outs))
    assert got == [True] * 12 + [False] * 4
    assert all(synth.verify_full(outs[i], k) is None for i, k in enumerate(keys[:12]))
    st = store.stats
    assert (st.reads, st.hits, st.misses, st.bounce_reads) == (16, 12, 4, 1)
    assert store.batched, "io_uring and openat2 are expected on this kernel"


def test_leading_counts_the_stored_prefix_held_blocks_included(store):
    keys = block_keys(list(range(16)), 4)
    _put(store, keys[0])
    _put(store, keys[2])
    assert store.leading(keys) == 1
    assert store.leading(keys, {keys[1]}) == 3      # keys[1] is on its way to the store
    assert store.leading([]) == 0


def test_an_empty_batch_is_answered_at_once(store):
    # An empty batch reached the ring reader, which never completed its future.
    import asyncio

    async def main():
        return await asyncio.wait_for(store.aread_many([], []), 5)
    assert asyncio.run(main()) == []


def test_a_ring_read_refused_o_direct_is_read_again_off_the_ring(store, monkeypatch):
    # A block whose O_DIRECT read the filesystem refused comes back from the ring as
    # "read again" (None): aread_many reads it buffered on the read pool. The ring's
    # own thread used to do that read, stalling every batch queued behind it.
    import asyncio
    import threading
    keys = block_keys(list(range(8)), 4)
    for k in keys:
        _put(store, k)
    real_outcome, real_batch = store.sio_outcome, store.read_batch
    refused, reread_on = [keys[1]], []

    def outcome(key, *a):
        if key in refused:      # as sio_outcome answers an EINVAL at the O_DIRECT stage
            refused.remove(key)
            store._direct_unsupported(OSError(errno.EINVAL, "Invalid argument"))
            return None
        return real_outcome(key, *a)

    def read_batch(ks, outs):
        reread_on.append((list(ks), threading.current_thread().name))
        return real_batch(ks, outs)
    monkeypatch.setattr(store, "sio_outcome", outcome)
    monkeypatch.setattr(store, "read_batch", read_batch)
    outs = [aligned_bytes(store.layout.full_bytes) for _ in keys]
    assert asyncio.run(store.aread_many(keys, outs)) == [True, True]
    assert [ks for ks, _ in reread_on] == [[keys[1]]]
    assert reread_on[0][1] != "dp-store-ring" and not store.direct     # buffered, now
    synth = SyntheticKV(store.layout)
    assert all(synth.verify_full(o, k) is None for o, k in zip(outs, keys))


# --- corruption: every kind is counted, quarantined, a miss ------------------------------

def _corrupt_and_read(store, damage):
    _put(store, KEYS[0])
    path = store.path_of(KEYS[0])
    data = bytearray(path.read_bytes())
    path.write_bytes(damage(data))
    ok, _ = _read(store, KEYS[0])
    return ok, path


def _rewrite_header(data, **fields):
    """Change header fields and re-seal the header hash (isolates one check at a time)."""
    fmt = "<8sHHI32sIIIIQQ16s"
    names = ["magic", "version", "header_bytes", "flags", "profile", "layers", "tokens",
             "token_bytes", "reserved", "payload", "digest", "key"]
    vals = dict(zip(names, struct.unpack_from(fmt, data)))
    vals.update(fields)
    packed = struct.pack(fmt, *(vals[n] for n in names))
    data[:len(packed)] = packed
    data[len(packed):len(packed) + 8] = struct.pack("<Q", xxhash.xxh3_64_intdigest(packed))
    return data


def _flip(offset):
    def damage(data):
        data[offset] ^= 0x01
        return data
    return damage


@pytest.mark.parametrize("damage", [
    pytest.param(_flip(HEADER_BYTES + 1000), id="payload-byte-flipped"),
    pytest.param(_flip(-1), id="last-payload-byte-flipped"),
    pytest.param(_flip(20), id="header-byte-flipped"),
    pytest.param(lambda d: d[:-1], id="truncated-by-one"),
    pytest.param(lambda d: d[:HEADER_BYTES + 4096], id="truncated-mid-payload"),
    pytest.param(lambda d: d[:100], id="truncated-in-header"),
    pytest.param(lambda d: d + b"x", id="trailing-byte"),
    pytest.param(lambda d: _rewrite_header(d, magic=b"NOTKVBLK"), id="wrong-magic"),
    pytest.param(lambda d: _rewrite_header(d, version=FORMAT_VERSION + 1), id="wrong-version"),
    pytest.param(lambda d: _rewrite_header(d, version=1), id="format-1"),
    pytest.param(lambda d: _rewrite_header(d, profile=b"qwen32b"), id="wrong-profile"),
    pytest.param(lambda d: _rewrite_header(d, tokens=8), id="wrong-layout"),
    pytest.param(lambda d: _rewrite_header(d, key=KEYS[1]), id="wrong-key"),
])
def test_corrupt_block_is_counted_quarantined_and_a_miss(both_paths, store, damage, caplog):
    with caplog.at_level(logging.WARNING, "dualpath.storage"):
        ok, path = _corrupt_and_read(store, damage)
    assert not ok
    assert store.stats.corrupt_blocks == 1 and store.stats.hits == 0
    assert not store.contains(KEYS[0])
    assert path.with_name(path.name + ".corrupt").exists()
    assert "corrupt block" in caplog.text


def test_header_magic_is_what_the_format_says(store):
    _put(store, KEYS[0])
    assert store.path_of(KEYS[0]).read_bytes()[:8] == MAGIC


def test_block_of_another_profile_with_same_geometry_is_rejected(tmp_path):
    demo = get_profile("demo", 4)
    twin = dataclasses.replace(demo, name="demo-twin")      # same layout, other model
    with BlockStore(tmp_path, demo) as a, BlockStore(tmp_path, twin) as b:
        _put(a, KEYS[0])
        b.path_of(KEYS[0]).parent.mkdir(parents=True)
        os.link(a.path_of(KEYS[0]), b.path_of(KEYS[0]))
        ok, _ = _read(b, KEYS[0])
        assert not ok and b.stats.corrupt_blocks == 1


# --- O_DIRECT fallback ---------------------------------------------------------------------

def _failing_open(flag: int, err: int):
    """os.open that fails with ``err`` whenever ``flag`` is among the flags."""
    real_open = os.open

    def fake_open(path, flags, *a, **kw):
        if flags & flag:
            raise OSError(err, os.strerror(err))
        return real_open(path, flags, *a, **kw)

    return fake_open


def _refuse_direct(monkeypatch, err: int = errno.EINVAL):
    """Setting O_DIRECT fails with ``err``: what a filesystem without it answers (the
    store opens a block without O_DIRECT, checks it is a regular file, then sets it)."""
    real = fcntl.fcntl

    def fake(fd, cmd, arg=0):
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(err, os.strerror(err))
        return real(fd, cmd, arg)

    monkeypatch.setattr(fcntl, "fcntl", fake)


def test_fallback_when_open_rejects_o_direct(tmp_path, monkeypatch, caplog):
    # Filesystems without O_DIRECT (older tmpfs, some FUSE) refuse the flag with EINVAL.
    with BlockStore(tmp_path, PROFILES[1]) as s:
        _put(s, KEYS[0])
        _refuse_direct(monkeypatch)
        with caplog.at_level(logging.WARNING, "dualpath.storage"):
            assert _read(s, KEYS[0])[0]
            ok, out = _read(s, KEYS[0])
        assert ok and SyntheticKV(s.layout).verify_full(out, KEYS[0]) is None
        assert not s.direct
        assert caplog.text.count("O_DIRECT is not supported") == 1


def test_fallback_when_the_read_rejects_o_direct(tmp_path, monkeypatch, caplog):
    # Others accept the flag and fail the read itself with EINVAL.
    real_preadv = os.preadv

    def preadv(fd, bufs, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, bufs, offset)

    with BlockStore(tmp_path, PROFILES[0]) as s:
        _put(s, KEYS[0])
        monkeypatch.setattr(os, "preadv", preadv)
        with caplog.at_level(logging.WARNING, "dualpath.storage"):
            ok, out = _read(s, KEYS[0])
        assert ok and SyntheticKV(s.layout).verify_full(out, KEYS[0]) is None
        assert not s.direct and "O_DIRECT is not supported" in caplog.text


def test_direct_io_on_fails_loudly_where_unsupported(tmp_path, monkeypatch):
    with BlockStore(tmp_path, PROFILES[0], direct_io="on") as s:
        _put(s, KEYS[0])
        _refuse_direct(monkeypatch)
        with pytest.raises(StorageError, match="O_DIRECT is not supported") as ei:
            _read(s, KEYS[0])
        assert ei.value.errno == errno.EINVAL


def test_direct_io_off_reads_buffered(both_paths, tmp_path):
    with BlockStore(tmp_path, PROFILES[1], direct_io="off") as s:
        _put(s, KEYS[0])
        ok, out = _read(s, KEYS[0])
        assert ok and not s.direct
        assert SyntheticKV(s.layout).verify_full(out, KEYS[0]) is None


# --- write errors: clear, typed, nothing half-written visible ----------------------------

def _no_files_left(store):
    return [p for p in store.dir.rglob("*") if p.is_file()]


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EDQUOT, errno.EIO])
def test_write_error_mid_payload_leaves_nothing(tmp_path, monkeypatch, err):
    # Mocked at the os level: we cannot fill a real disk in a unit test.
    def failing_writev(fd, bufs):
        raise OSError(err, os.strerror(err))

    with BlockStore(tmp_path, PROFILES[0]) as s:
        buf = aligned_bytes(s.layout.full_bytes)
        monkeypatch.setattr(os, "writev", failing_writev)
        with pytest.raises(StorageError) as ei:
            s.write(KEYS[0], buf)
        assert ei.value.errno == err
        assert str(s.path_of(KEYS[0])) in str(ei.value)
        assert isinstance(ei.value, DualPathError)
        assert _no_files_left(s) == []
    assert "full" in str(StorageError(errno.ENOSPC, "writing", "/x"))


def test_write_to_read_only_dir_is_a_clear_error_mocked(tmp_path, monkeypatch):
    # Mocked EROFS at open(): root ignores chmod, so this runs everywhere.
    with BlockStore(tmp_path, PROFILES[0]) as s:
        monkeypatch.setattr(os, "open", _failing_open(os.O_CREAT, errno.EROFS))
        with pytest.raises(StorageError, match="read-only") as ei:
            s.write(KEYS[0], aligned_bytes(s.layout.full_bytes))
        assert ei.value.errno == errno.EROFS and _no_files_left(s) == []


_RO_CHILD = """
import sys
from dualpath.kv.profiles import get_profile
from dualpath.storage import BlockStore, StorageError
from dualpath.storage.store import aligned_bytes
s = BlockStore(sys.argv[1], get_profile("demo", 4))
try:
    s.write(bytes(16), aligned_bytes(s.layout.full_bytes))
except StorageError as e:
    print("errno", e.errno, e)
"""


def test_write_to_a_really_read_only_directory(tmp_path):
    # Real read-only storage: as root, a read-only bind mount in a private mount namespace
    # (chmod does not stop root); otherwise chmod.
    root = tmp_path / "ro"
    with BlockStore(root, PROFILES[0]):
        pass                                   # the store directory exists
    if os.geteuid() == 0:
        cmd = ["unshare", "-m", "sh", "-c",
               (f'mount --bind "{root}" "{root}" && mount -o remount,bind,ro "{root}" && '
               f'exec "{sys.executable}" -c "$0" "{root}"'), _RO_CHILD]
    else:
        root.chmod(0o555)
        (root / "demo-t4").chmod(0o555)
        cmd = [sys.executable, "-c", _RO_CHILD, str(root)]
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120)
    if os.geteuid() == 0 and "errno" not in r.stdout and r.returncode != 0:
        pytest.skip(f"cannot make a read-only bind mount here: {r.stderr.strip()}; "
                    "test_write_to_read_only_dir_is_a_clear_error_mocked covers the logic")
    assert f"errno {errno.EROFS if os.geteuid() == 0 else errno.EACCES}" in r.stdout, r
    # The cause, not a guess first: the fan-out directory could not be made because the
    # store is read-only, not because of "a symlink or a file in the way".
    assert "symlink" not in r.stdout, r.stdout
    assert not [p for p in root.rglob("*") if p.is_file()]


def test_sweep_removes_temp_files_of_dead_writers(store):
    _put(store, KEYS[0])
    d = store.path_of(KEYS[1]).parent
    d.mkdir(parents=True, exist_ok=True)
    (d / f".{KEYS[1].hex()}.kvb.dead.tmp").write_bytes(b"partial")
    assert store.sweep_temp(max_age_s=3600) == 0     # too young: maybe a live writer
    assert store.sweep_temp(max_age_s=0) == 1
    assert [p.name for p in _no_files_left(store)] == [store.path_of(KEYS[0]).name]


def test_layout_geometry_from_profile(store):
    assert store.layout == BlockLayout.of(store.profile)


# --- the ring reader (a dp_sio_ring fed by one thread): what the read queue uses -------

def test_the_ring_reader_serves_concurrent_batches_each_block_into_its_buffer(store):
    # More blocks in flight than the ring's depth, from several callers at once, misses
    # among them: each caller gets its own outcomes and bytes, and the ring is idle after.
    keys = block_keys(list(range(4 * 40)), 4)          # 40 keys
    synth = SyntheticKV(store.layout)
    present = set(keys[::3])
    for k in present:
        _put(store, k)
    outs = [aligned_bytes(store.layout.full_bytes) for _ in keys]

    async def main():
        parts = [range(i, len(keys), 5) for i in range(5)]      # 5 callers, 8 each
        return await asyncio.gather(*(store.aread_many([keys[i] for i in p],
                                                       [outs[i] for i in p]) for p in parts)), parts

    got, parts = asyncio.run(main())
    for p, oks in zip(parts, got):
        assert oks == [keys[i] in present for i in p]
        assert all(synth.verify_full(outs[i], keys[i]) is None for i in p if keys[i] in present)
    st = store.stats
    assert (st.reads, st.hits, st.misses) == (40, len(present), 40 - len(present))
    rings = store._rings
    assert len(rings) == store.read_rings == 4             # the default: four rings
    assert all(lib.dp_sio_ring_inflight(r._ring) == 0 for r in rings)
    store.close()
    assert not any(r._thread.is_alive() for r in rings)
    store.close()                                          # idempotent


def test_a_batch_handed_to_a_ring_after_close_is_refused_not_lost(store):
    # aread_many picks a ring under the store's lock and hands it the batch after: a
    # close() in between used to queue the batch behind the stop, where nothing would
    # ever complete its future (the caller waited for ever).
    key = block_keys(list(range(4)), 4)[0]
    _put(store, key)
    ring = store._ring_reader()
    assert ring is not None
    store.close()
    with pytest.raises(StorageError, match="closed"):
        ring.submit([key], [aligned_bytes(store.layout.full_bytes)])


def test_a_cancelled_ring_read_returns_only_once_its_reads_landed(store):
    # The ring writes into the caller's buffers until each read lands: a cancelled caller
    # must not get them back before that (it would hand out slots still being written).
    keys = block_keys(list(range(4 * 16)), 4)
    for k in keys:
        _put(store, k)
    outs = [aligned_bytes(store.layout.full_bytes) for _ in keys]

    async def main():
        task = asyncio.create_task(store.aread_many(keys, outs))
        await asyncio.sleep(0)                             # handed to the ring
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return sum(lib.dp_sio_ring_inflight(r._ring) for r in store._rings)

    assert asyncio.run(main()) == 0
    synth = SyntheticKV(store.layout)
    assert all(synth.verify_full(o, k) is None for o, k in zip(outs, keys))


def test_dp_sio_ring_keeps_its_depth_and_hands_every_item_back_once(store):
    # The C mechanism alone: a ring of depth 2 with a backlog of 4 takes 4 of 5 items
    # pushed (the last is pushed again once there is room), returns each item once with
    # its outcome (a missing file too), and refuses to be destroyed while items are
    # queued or in flight.
    keys = block_keys(list(range(4 * 5)), 4)
    for k in keys[:4]:
        _put(store, k)                                     # keys[4] is missing
    pages = aligned_bytes(10 * 4096).reshape(10, 4096)
    bodies = [aligned_bytes(store.layout.full_bytes) for _ in keys]
    cut = store.layout.full_bytes - store.layout.full_bytes % 4096
    items, paths = store.sio_items(keys, [b[:cut] for b in bodies], pages)
    ring = lib.dp_sio_ring_create(store._root_fd, 2, 4, 1, ffi.NULL, 0)
    assert ring != ffi.NULL
    assert lib.dp_sio_ring_push(ring, items, 5) == 4
    assert lib.dp_sio_ring_inflight(ring) == 4
    assert lib.dp_sio_ring_destroy(ring) == -errno.EBUSY
    done = ffi.new("struct dp_sio_item *[]", 4)
    assert lib.dp_sio_ring_step(ring, done, 3, 1) == -errno.EINVAL     # < 2 x depth
    seen, pushed = [], 4
    while len(seen) < 5:
        if pushed < 5:
            pushed += lib.dp_sio_ring_push(ring, items + pushed, 5 - pushed)
        got = lib.dp_sio_ring_step(ring, done, 4, 1)
        assert 0 < got <= 4
        seen += [(int(ffi.cast("uintptr_t", done[k])) - int(ffi.cast("uintptr_t", items)))
                 // ffi.sizeof("struct dp_sio_item") for k in range(got)]
        assert lib.dp_sio_ring_inflight(ring) == pushed - len(seen)
    assert sorted(seen) == [0, 1, 2, 3, 4]
    assert [items[j].err for j in range(5)] == [0, 0, 0, 0, errno.ENOENT]
    assert all(items[j].hashed and items[j].got == 4096 + store.layout.full_bytes
               for j in range(4))
    assert lib.dp_sio_ring_destroy(ring) == 0
    del paths


def test_a_ring_beneath_a_root_that_is_no_directory_is_refused(store, tmp_path):
    # openat2 is probed until it first works; later rings still refuse a root that is
    # not a directory, rather than failing each file as a miss.
    ok = lib.dp_sio_ring_create(store._root_fd, 2, 4, 1, ffi.NULL, 0)
    assert ok != ffi.NULL
    assert lib.dp_sio_ring_destroy(ok) == 0
    f = tmp_path / "not-a-dir"
    f.write_bytes(b"x")
    fd = os.open(f, os.O_RDONLY)
    try:
        assert lib.dp_sio_ring_create(fd, 2, 4, 1, ffi.NULL, 0) == ffi.NULL
        assert ffi.errno == errno.ENOTDIR
    finally:
        os.close(fd)
    assert lib.dp_sio_ring_create(-1, 2, 4, 1, ffi.NULL, 0) == ffi.NULL
    assert ffi.errno == errno.EBADF


def test_read_rings_0_reads_each_batch_with_a_ring_of_its_own(tmp_path):
    # storage.read_rings = 0: no ring reader threads; a batch is one C call on the read
    # pool (the path before the ring readers, kept for comparison and as a fallback).
    keys = block_keys(list(range(4 * 8)), 4)
    with BlockStore(tmp_path, PROFILES[0], read_rings=0) as s:
        for k in keys[:6]:
            _put(s, k)
        outs = [aligned_bytes(s.layout.full_bytes) for _ in keys]
        assert asyncio.run(s.aread_many(keys, outs)) == [True] * 6 + [False] * 2
        assert s._rings == [] and s.batched
    with pytest.raises(UsageError, match="read_rings must be 0 to 64"):
        BlockStore(tmp_path, PROFILES[0], read_rings=65)
