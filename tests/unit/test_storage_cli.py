"""`dualpath store usage|evict|scrub|sweep` (dualpath/storage/cli.py) on real files."""

import json
import os
import time

import pytest

from dualpath import cli
from dualpath.kv.prefix import block_keys, tenant_root, tenant_tag
from dualpath.kv.profiles import geometry_profile, get_profile
from dualpath.kv.synth import SyntheticKV
from dualpath.storage import BlockStore
from dualpath.storage.cli import parse_size
from dualpath.storage.format import HEADER_BYTES
from dualpath.storage.ledger import LedgerWriter
from dualpath.storage.store import aligned_bytes

PROFILE = get_profile("demo", 4)            # 64 KiB blocks
KEYS = block_keys(list(range(4 * 10)), 4)   # 10 chained keys
ON_DISK = HEADER_BYTES + 65536
NS = "demo-t4"


def _write(root, keys, profile=PROFILE, start=None):
    """Blocks of ``keys`` in the store at ``root``, block i with mtime start + i (s)."""
    start = time.time() - 3600 if start is None else start
    with BlockStore(root, profile, read_workers=1, fsync=False, index_max_keys=0) as s:
        buf = aligned_bytes(s.layout.full_bytes)
        for i, k in enumerate(keys):
            SyntheticKV(s.layout).fill_full(buf, k)
            assert s.write(k, buf)
            os.utime(s.path_of(k), (start + i, start + i))
        return s.dir, [s.path_of(k) for k in keys]


def run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return rc, out, err


def run_json(capsys, *argv):
    rc, out, _ = run(capsys, *argv, "--json")
    return rc, json.loads(out)


def _config(tmp_path, root, **storage):
    lines = [f'dir = "{root}"'] + [f"{k} = {v}" for k, v in storage.items()]
    path = tmp_path / "dp.toml"
    path.write_text("[storage]\n" + "\n".join(lines) + "\n")
    return str(path)


# --- usage ----------------------------------------------------------------------------
def test_usage_counts_match_the_files(tmp_path, capsys):
    root = tmp_path / "kv"
    _, paths = _write(root, KEYS[:5], start=1_000_000)
    fan = paths[0].parent
    (fan / f".{paths[0].name}.0123456789ab.tmp").write_bytes(b"x" * 10)
    (fan / f"{'ab' * 16}.kvb.corrupt").write_bytes(b"y" * 7)
    (root / ".evictor").mkdir()                     # the store's evictor's publication
    (root / ".evictor" / "usage.json").write_text(json.dumps(
        {"usage_bytes": 123, "capacity_bytes": 456, "writers": 1, "consumed": {},
         "evictor": "host-1-abcd", "time": time.time() - 5, "namespaces": {NS: 123}}))
    _write(root, KEYS[:3], profile=get_profile("demo", 8))    # a second namespace
    cfg = _config(tmp_path, root, capacity_gib=0.001, namespace_quota_gib=0.0005)

    rc, got = run_json(capsys, "store", "usage", "-c", cfg)
    assert rc == 0 and got["dir"] == str(root)
    ns, ns8 = got["namespaces"]
    assert ns["namespace"] == NS and ns["blocks"] == 5 and ns8["blocks"] == 3
    assert ns["bytes"] == sum(os.path.getsize(p) for p in paths) == 5 * ON_DISK
    assert (ns["oldest_mtime"], ns["newest_mtime"]) == (1_000_000, 1_000_004)
    assert (ns["temp_files"], ns["temp_bytes"], ns["corrupt_files"], ns["corrupt_bytes"]) \
        == (1, 10, 1, 7)
    # The bound is the store's (every namespace), the quota each namespace's.
    assert got["capacity_bytes"] == int(0.001 * 2**30)
    assert got["bytes"] == ns["bytes"] + ns8["bytes"]
    assert got["used_fraction"] == pytest.approx(got["bytes"] / int(0.001 * 2**30), rel=1e-5)
    assert ns["quota_bytes"] == int(0.0005 * 2**30)
    assert ns["used_fraction"] == pytest.approx(5 * ON_DISK / int(0.0005 * 2**30), rel=1e-5)
    assert got["evictor"]["evictor"] == "host-1-abcd" and got["evictor"]["usage_bytes"] == 123
    assert got["evictor"]["namespaces"] == {NS: 123}
    assert 4 <= got["evictor"]["age_s"] < 60

    rc, out, _ = run(capsys, "store", "usage", "-c", cfg)
    assert rc == 0 and NS in out and "evictor host-1-abcd" in out


def test_usage_by_tenant_account_names_those_it_knows_with_their_quotas(tmp_path, capsys):
    root = tmp_path / "kv"
    ids = list(range(4 * 6))
    acme = block_keys(ids, 4, tenant_root("acme")) + block_keys(ids, 4, tenant_root("acme/s1"))
    _write(root, KEYS[:2] + acme + block_keys(ids, 4, tenant_root("beta"))[:3])
    path = tmp_path / "dp.toml"
    path.write_text(f'[storage]\ndir = "{root}"\ncapacity_gib = 1\n'
                    'tenant_quotas = { acme = 0.5 }\n')
    rc, got = run_json(capsys, "store", "usage", "-c", str(path), "--tenant", "beta")
    assert rc == 0
    [ns] = got["namespaces"]
    assert ns["tenants"] == got["tenants"]          # one namespace: the store's
    rows = {t["tenant"]: t for t in ns["tenants"]}
    assert rows["acme"]["blocks"] == 12 and rows["acme"]["bytes"] == 12 * ON_DISK
    assert rows["acme"]["quota_bytes"] == 2**29
    assert rows["acme"]["tag"] == f"{tenant_tag('acme'):06x}"
    assert (rows["beta"]["blocks"], rows["beta"]["quota_bytes"]) == (3, 0)
    assert rows[""]["blocks"] == 2 and [t["tenant"] for t in ns["tenants"]] == \
        ["acme", "beta", ""]                       # most bytes first
    rc, out, _ = run(capsys, "store", "usage", "-c", str(path))
    assert rc == 0 and "tenant acme" in out and "quota 512.00 MiB" in out
    assert "tenant (default)" in out and "tenant ?" in out     # beta unnamed here


def test_usage_dir_overrides_the_config_and_a_missing_store_exits_2(tmp_path, capsys):
    root = tmp_path / "kv"
    _write(root, KEYS[:2])
    cfg = _config(tmp_path, tmp_path / "elsewhere")
    rc, got = run_json(capsys, "store", "usage", "-c", cfg, "--dir", str(root))
    assert rc == 0 and [n["blocks"] for n in got["namespaces"]] == [2]
    rc, _, err = run(capsys, "store", "usage", "-c", cfg)
    assert rc == cli.EXIT_USAGE and "elsewhere" in err and "does not exist" in err
    rc, _, err = run(capsys, "store", "usage", "--dir", str(root), "--namespace", "nope-t4")
    assert rc == cli.EXIT_USAGE and "--namespace 'nope-t4'" in err and NS in err


# --- evict ----------------------------------------------------------------------------
def test_evict_removes_the_least_recently_used_first_and_tells_the_indexes(tmp_path, capsys):
    root = tmp_path / "kv"
    ns_dir, paths = _write(root, KEYS[:6])     # mtimes: block 0 the oldest
    hits = LedgerWriter(ns_dir, sync=False)
    hits.hit([KEYS[0]])                        # block 0 hit now: the most recent
    hits.flush()
    with BlockStore(root, PROFILE, read_workers=1, fsync=False) as other:
        assert other.leading(KEYS[:6]) == 6 and len(other.index) == 6

        rc, got = run_json(capsys, "store", "evict", "--dir", str(root), "--to",
                           str(3 * ON_DISK + 100))
        assert rc == 0
        [ns] = got["namespaces"]
        assert ns["keys"] == [k.hex() for k in KEYS[1:4]]
        assert (ns["evicted"], ns["evicted_bytes"]) == (3, 3 * ON_DISK)
        assert (ns["blocks_after"], ns["bytes_after"]) == (3, 3 * ON_DISK)
        assert [p.exists() for p in paths] == [True, False, False, False, True, True]
        assert sum(os.path.getsize(p) for p in paths if p.exists()) <= 3 * ON_DISK + 100

        other.index.refresh(force=True)        # the E records in the ledger
        assert len(other.index) == 3
    hits.close()


def test_evict_to_a_size_is_the_stores_least_recent_first_across_namespaces(tmp_path,
                                                                             capsys):
    root = tmp_path / "kv"
    t0 = time.time() - 3600
    _, p4 = _write(root, KEYS[:4], start=t0)                    # the oldest: 4 x 68 KiB
    p8 = get_profile("demo", 8)
    k8 = block_keys(list(range(8 * 3)), 8)
    _, p8s = _write(root, k8, profile=p8, start=t0 + 100)       # newer: 3 x 132 KiB
    on_disk8 = HEADER_BYTES + 2 * 65536
    rc, got = run_json(capsys, "store", "evict", "--dir", str(root), "--to",
                       str(2 * on_disk8 + ON_DISK))
    assert rc == 0
    ns4, ns8 = got["namespaces"]
    # The store's least recent go first: every demo-t4 block, then demo-t8's oldest.
    assert ns4["evicted"] == 4 and ns8["keys"] == [k8[0].hex()]
    assert got["bytes_after"] == 2 * on_disk8 <= 2 * on_disk8 + ON_DISK
    assert not any(p.exists() for p in p4) and [p.exists() for p in p8s] == [False, True, True]
    # --namespace: that namespace alone to the size.
    rc, got = run_json(capsys, "store", "evict", "--dir", str(root), "--to", "0",
                       "--namespace", "demo-t8", "--dry-run")
    assert rc == 0 and [n["namespace"] for n in got["namespaces"]] == ["demo-t8"]
    assert got["namespaces"][0]["evicted"] == 2


def test_evict_to_a_size_in_units_and_the_human_report(tmp_path, capsys):
    root = tmp_path / "kv"
    _, paths = _write(root, KEYS[:4])
    rc, out, _ = run(capsys, "store", "evict", "--dir", str(root), "--to", "0.15M")
    assert rc == 0 and "evicted 2 blocks" in out and "now 2 blocks" in out
    assert [p.exists() for p in paths] == [False, False, True, True]


def test_evict_dry_run_removes_nothing(tmp_path, capsys):
    root = tmp_path / "kv"
    _, paths = _write(root, KEYS[:5])
    rc, got = run_json(capsys, "store", "evict", "--dir", str(root), "--to", "0",
                       "--dry-run")
    [ns] = got["namespaces"]
    assert rc == 0 and got["dry_run"] and ns["evicted"] == 5
    assert ns["keys"] == [k.hex() for k in KEYS[:5]] and ns["bytes_after"] == 0
    assert all(p.exists() for p in paths)
    rc, out, _ = run(capsys, "store", "evict", "--dir", str(root), "--to", "1G",
                     "--dry-run")
    assert rc == 0 and "would evict 0 blocks" in out and all(p.exists() for p in paths)


@pytest.mark.parametrize("bad", ["10X", "-5", "1.5.G", "G", ""])
def test_evict_a_bad_size_exits_2_naming_the_argument(tmp_path, capsys, bad):
    root = tmp_path / "kv"
    _, paths = _write(root, KEYS[:1])
    rc, _, err = run(capsys, "store", "evict", "--dir", str(root), f"--to={bad}")
    assert rc == cli.EXIT_USAGE and f"--to {bad!r}" in err and "not a size" in err
    assert paths[0].exists()


def test_parse_size_units():
    assert parse_size("10G") == 10 * 2**30
    assert parse_size("512M") == 512 * 2**20
    assert parse_size("1.5GiB") == 3 * 2**29
    assert parse_size("4096") == 4096
    assert parse_size("2kb") == 2000 and parse_size("1 TiB") == 2**40


# --- scrub ----------------------------------------------------------------------------
def test_scrub_quarantines_a_flipped_byte_and_exits_1(tmp_path, capsys):
    root = tmp_path / "kv"
    _, paths = _write(root, KEYS[:4])
    with open(paths[2], "r+b") as f:
        f.seek(HEADER_BYTES + 1000)
        b = f.read(1)
        f.seek(HEADER_BYTES + 1000)
        f.write(bytes([b[0] ^ 0x40]))
    rc, got = run_json(capsys, "store", "scrub", "--dir", str(root))
    assert rc == 1
    assert (got["checked"], got["ok"], got["corrupt"], got["missing"]) == (4, 3, 1, 0)
    assert got["namespaces"][0]["corrupt"] == [KEYS[2].hex()]
    assert got["bytes"] == 3 * 65536
    assert not paths[2].exists() and paths[2].with_name(paths[2].name + ".corrupt").exists()
    # Quarantined: the next scrub does not see it, and is clean.
    rc, out, _ = run(capsys, "store", "scrub", "--dir", str(root))
    assert rc == 0 and "checked 3 blocks" in out


def test_scrub_a_clean_store_exits_0_with_progress_and_rate(tmp_path, capsys):
    root = tmp_path / "kv"
    _write(root, KEYS[:4])
    rc, out, err = run(capsys, "store", "scrub", "--dir", str(root), "--json",
                       "--progress", "--rate", "1")
    got = json.loads(out)
    assert rc == 0 and (got["checked"], got["ok"], got["corrupt"]) == (4, 4, 0)
    assert got["seconds"] >= 4 * 65536 / 1e6 * 0.9     # 1 MB/s
    assert "4/4 blocks" in err and "MB/s" in err
    rc, _, err = run(capsys, "store", "scrub", "--dir", str(root), "--rate", "-1")
    assert rc == cli.EXIT_USAGE and "--rate" in err


def test_scrub_finds_the_geometry_of_an_engine_namespace_in_its_headers(tmp_path, capsys):
    root = tmp_path / "kv"
    profile = geometry_profile("vllm-0123456789ab", 3, 512, 8)
    keys = block_keys(list(range(8 * 3)), 8)
    _, paths = _write(root, keys, profile)
    with open(paths[1], "r+b") as f:
        f.seek(HEADER_BYTES + 5)
        f.write(b"\xff\xfe")
    rc, got = run_json(capsys, "store", "scrub", "--dir", str(root))
    [ns] = got["namespaces"]
    assert rc == 1 and ns["namespace"] == "vllm-0123456789ab-t8"
    assert (ns["checked"], ns["ok"], ns["corrupt"]) == (3, 2, [keys[1].hex()])
    assert ns["bytes"] == 2 * 3 * 8 * 512


# --- sweep ----------------------------------------------------------------------------
def test_sweep_removes_old_temp_files_and_keeps_fresh_ones(tmp_path, capsys):
    root = tmp_path / "kv"
    _, paths = _write(root, KEYS[:2])
    old = paths[0].parent / f".{paths[0].name}.aaaaaaaaaaaa.tmp"
    fresh = paths[1].parent / f".{paths[1].name}.bbbbbbbbbbbb.tmp"
    old.write_bytes(b"x")
    fresh.write_bytes(b"x")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    rc, got = run_json(capsys, "store", "sweep", "--dir", str(root), "--max-age", "600")
    assert rc == 0 and got["removed"] == 1 and got["namespaces"][0]["temp_files_left"] == 1
    assert not old.exists() and fresh.exists() and all(p.exists() for p in paths)


def test_sweep_defaults_to_the_configs_temp_max_age(tmp_path, capsys):
    root = tmp_path / "kv"
    _, paths = _write(root, KEYS[:1])
    tmp = paths[0].parent / f".{paths[0].name}.cccccccccccc.tmp"
    tmp.write_bytes(b"x")
    os.utime(tmp, (time.time() - 100, time.time() - 100))
    rc, out, _ = run(capsys, "store", "sweep", "-c", _config(tmp_path, root))
    assert rc == 0 and "removed 0 temp files older than 600 s" in out and tmp.exists()
    rc, out, _ = run(capsys, "store", "sweep", "-c",
                     _config(tmp_path, root, temp_max_age_s=50))
    assert rc == 0 and "removed 1 temp files older than 50 s" in out and not tmp.exists()


def test_scrub_skips_a_namespace_whose_geometry_no_header_names(tmp_path, capsys):
    # An unknown profile name and no header that checks out: nothing to read it as, so
    # nothing is read or quarantined, and the scrub does not pass.
    junk = tmp_path / "kv" / "mystery-t16" / "ab" / "cd" / ("abcd" + "0" * 28 + ".kvb")
    junk.parent.mkdir(parents=True)
    junk.write_bytes(b"\0" * 8192)
    rc, got = run_json(capsys, "store", "scrub", "--dir", str(tmp_path / "kv"))
    [ns] = got["namespaces"]
    assert rc == 1 and ns["checked"] == 0 and "names its geometry" in ns["skipped"]
    assert junk.exists()
