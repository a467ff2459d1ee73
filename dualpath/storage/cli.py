"""`dualpath store usage|evict|scrub|sweep`: look after a block store from the command line.

Each namespace of the store (a directory ``<profile>-t<block tokens>`` of
``storage.dir``, docs/storage.md) is opened as a :class:`BlockStore` without an index
and without a capacity: this command is never the store's evictor, it acts once and
leaves. What it removes goes through the store's own calls, so the nodes hear of it:

- ``usage``: blocks, their bytes and mtimes, temp and quarantined files, the configured
  bound (``storage.capacity_gib``) and the evictor's last publication; blocks and bytes
  of each tenant account (by the tag its keys carry), against its quota.
- ``evict --to SIZE``: least recently used blocks removed (``BlockStore.delete``: an E
  record in the ledger, so every node's index drops the key) until the store (every
  namespace together, least recent first across them; with ``--namespace``, that one)
  holds at most SIZE bytes of blocks. Recency as the evictor sees it (lru.py): each block's
  mtime, then the hits of the ledger's ``.hits`` files (a file's hits at its mtime).
  Leases are not honoured: the operator asked for a size.
- ``scrub``: every block read and checked (``BlockStore.read_into``); a corrupt one is
  quarantined by the store (renamed ``.corrupt``, an E record). Exit 1 when any was.
- ``sweep``: temp files of dead writers removed (``BlockStore.sweep_temp``).

Every subcommand prints one JSON object with ``--json``, a short table otherwise.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import stat
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dualpath.errors import UsageError
from dualpath.kv.layout import BlockLayout
from dualpath.kv.prefix import MAX_TENANT_CHARS, key_tag, tenant_tag
from dualpath.kv.profiles import PROFILES, ModelProfile, geometry_profile, get_profile
from dualpath.storage.format import HEADER_BYTES, check_header
from dualpath.storage.ledger import HIT, LedgerTail
from dualpath.storage.lru import LruCore
from dualpath.storage.publication import read_publication, usage_path
from dualpath.storage.store import BlockStore, aligned_bytes
from dualpath.storage.tree import (
    BLOCK_NAME_LEN,
    HEX,
    NAMESPACE,
    SUFFIX,
    leaf_entries,
    regular_stat,
)

# The block header's profile name and layout (format.py: offsets 16..60); what it says
# is trusted only once format.check_header accepts the header with it.
_HEAD_GEOMETRY = struct.Struct("<16x32sIII")
_PROFILE_TRIES = 16           # block headers tried for a namespace's geometry
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")
_UNITS = {"": 1, "b": 1,
          "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30,
          "t": 2**40, "tib": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_LIST_SHOWN = 20              # victims a dry run's table lists (--json lists all)


def register(sub) -> None:
    import argparse

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-c", "--config", help="TOML config ([storage]; default: embedded "
                        "defaults)")
    common.add_argument("--dir", help="the store directory (overrides storage.dir)")
    common.add_argument("--json", action="store_true", help="one JSON object instead of a "
                        "table")
    p = sub.add_parser("store", help="look after the block store: usage, evict, scrub, "
                       "sweep")
    ssub = p.add_subparsers(dest="store_cmd", metavar="ACTION", required=True)

    u = ssub.add_parser("usage", parents=[common], help="blocks, bytes, temp and "
                        "quarantined files of each namespace, against storage.capacity_gib")
    u.add_argument("--namespace", metavar="NS", help="only this namespace")
    u.add_argument("--tenant", metavar="NAME", action="append", help="name this tenant "
                   "account's tag in the report (repeatable; those of "
                   "storage.tenant_quotas are named anyway)")
    u.set_defaults(func=_usage)

    e = ssub.add_parser("evict", parents=[common], help="remove least recently used blocks "
                        "until the store (or a namespace) holds at most SIZE bytes")
    e.add_argument("--to", required=True, metavar="SIZE",
                   help="bytes to keep in the store (every namespace together), or in "
                   "--namespace: 10G, 512M, 1.5GiB (K/M/G/T and KiB/MiB/GiB/TiB are powers "
                   "of 1024, KB/MB/GB/TB of 1000), or bytes")
    e.add_argument("--namespace", metavar="NS", help="only this namespace (default: the "
                   "whole store, least recent first across its namespaces)")
    e.add_argument("--dry-run", action="store_true", help="list what would go; remove "
                   "nothing")
    e.set_defaults(func=_evict)

    s = ssub.add_parser("scrub", parents=[common], help="read and check every block; "
                        "quarantine corrupt ones (exit 1 when any)")
    s.add_argument("--namespace", metavar="NS", help="only this namespace")
    s.add_argument("--rate", type=float, default=0.0, metavar="MB/s",
                   help="read at most this many MB (10^6 bytes) per second; 0 = no limit")
    s.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a progress line on stderr (default: when stderr is a terminal)")
    s.set_defaults(func=_scrub)

    w = ssub.add_parser("sweep", parents=[common], help="remove temp files of writers "
                        "that died")
    w.add_argument("--max-age", type=float, default=None, metavar="SECONDS",
                   help="remove temp files older than this (default: "
                   "storage.temp_max_age_s)")
    w.add_argument("--namespace", metavar="NS", help="only this namespace")
    w.set_defaults(func=_sweep)


# --- sizes ----------------------------------------------------------------------------
def parse_size(text: str, what: str = "--to") -> int:
    """Bytes of ``10G``, ``512M``, ``1.5GiB``, ``4096``; UsageError naming ``what``."""
    m = _SIZE.match(text)
    mult = _UNITS.get(m.group(2).lower()) if m else None
    if m is None or mult is None or not math.isfinite(float(m.group(1)) * mult):
        raise UsageError(f"{what} {text!r} is not a size: a number of bytes, or one with "
                         f"a unit (K, M, G, T or KiB.. TiB: powers of 1024; KB.. TB: of "
                         f"1000), e.g. 10G, 512M, 1.5GiB")
    return math.floor(float(m.group(1)) * mult)


def fmt_bytes(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _fmt_time(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t is not None else "-"


# --- namespaces -----------------------------------------------------------------------
@dataclass(frozen=True)
class Namespace:
    name: str          # the directory's name: <profile>-t<tokens>
    profile: str
    tokens: int
    dir: Path


def namespaces(root: Path, only: str | None = None) -> list[Namespace]:
    """The namespace directories of the store at ``root`` (symlinks are not followed),
    by name; ``only``: that one (UsageError naming the others when it is not there)."""
    if not root.is_dir():
        raise UsageError(f"the store directory {root} does not exist (storage.dir, or "
                         f"--dir)")
    found = []
    with os.scandir(root) as it:
        for e in it:
            m = NAMESPACE.match(e.name)
            if m and e.is_dir(follow_symlinks=False):
                found.append(Namespace(e.name, m["name"], int(m["tokens"]), Path(e.path)))
    found.sort(key=lambda ns: ns.name)
    if only is not None:
        picked = [ns for ns in found if ns.name == only]
        if not picked:
            raise UsageError(f"--namespace {only!r}: no such namespace in {root}; there "
                             f"are: {', '.join(ns.name for ns in found) or '(none)'}")
        return picked
    return found


def _extras(ns_dir: Path) -> dict[str, int]:
    """Temp files (writes in progress, or of writers that died) and quarantined blocks."""
    out = {"temp_files": 0, "temp_bytes": 0, "corrupt_files": 0, "corrupt_bytes": 0}
    for _, e in leaf_entries(ns_dir):
        n = e.name
        kind = "temp" if n.startswith(".") and n.endswith(".tmp") else \
            "corrupt" if n.endswith(SUFFIX + ".corrupt") else None
        if kind is None:
            continue
        st = regular_stat(e)
        if st is not None:
            out[f"{kind}_files"] += 1
            out[f"{kind}_bytes"] += st.st_size
    return out


def _header_profile(ns: Namespace, path: str, key: bytes) -> ModelProfile | None:
    """The profile a block file's header describes, when its header checks out."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        head = os.pread(fd, HEADER_BYTES, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(head) < _HEAD_GEOMETRY.size:
        return None
    raw_name, layers, tokens, token_bytes = _HEAD_GEOMETRY.unpack_from(head)
    name = raw_name.rstrip(b"\0").decode(errors="replace")
    if name != ns.profile or tokens != ns.tokens or min(layers, token_bytes) <= 0:
        return None
    layout = BlockLayout(layers, tokens, token_bytes)
    if check_header(head, name, layout, key)[0] is not None:
        return None
    return geometry_profile(name, layers, token_bytes, tokens)


def resolve_profile(ns: Namespace) -> ModelProfile | None:
    """The namespace's profile: a known profile by its name, else the geometry of the
    first of its blocks whose header checks out (a vLLM engine's namespace, named after
    its model and format); None when none of the first few does."""
    if ns.profile in PROFILES:
        return get_profile(ns.profile, ns.tokens)
    tries = 0
    for _, e in leaf_entries(ns.dir):
        n = e.name
        if len(n) != BLOCK_NAME_LEN or not n.endswith(SUFFIX) or not set(n[:32]) <= HEX:
            continue
        profile = _header_profile(ns, e.path, bytes.fromhex(n[:32]))
        if profile is not None:
            return profile
        tries += 1
        if tries >= _PROFILE_TRIES:
            break
    return None


def _open(ns: Namespace, storage, profile: ModelProfile | None = None, *,
          integrity_key: bytes | None = None) -> BlockStore:
    """The namespace's store, as an admin opens it: no index, no capacity (never the
    evictor). ``profile`` None: a stand-in geometry, for what needs none (walk, delete,
    sweep)."""
    if profile is None:
        profile = get_profile(ns.profile, ns.tokens) if ns.profile in PROFILES else \
            geometry_profile(ns.profile, 1, 1, ns.tokens)
    # The store's "opened" INFO line is a daemon's; here it would only bury the report.
    # Its warnings (a corrupt block, O_DIRECT refused) still show.
    log = logging.getLogger("dualpath.storage")
    level = log.level
    if log.getEffectiveLevel() == logging.INFO:       # the default; DEBUG shows all
        log.setLevel(logging.WARNING)
    try:
        return BlockStore(ns.dir.parent, profile, read_workers=1, write_workers=1,
                          read_rings=0, direct_io=storage.direct_io, verify_checksum=True,
                          fsync=storage.fsync, integrity_key=integrity_key, capacity=None,
                          index_max_keys=0)
    finally:
        log.setLevel(level)


def _storage(args):
    from dualpath import config

    storage = config.load(args.config).storage
    root = Path(args.dir).expanduser() if args.dir else storage.resolved_dir()
    return storage, root


def _print_json(obj: dict) -> None:
    print(json.dumps(obj, indent=2))


# --- usage ----------------------------------------------------------------------------
def _publication(root: Path, now: float) -> dict | None:
    path = usage_path(root)
    try:
        d = read_publication(path)
        published = float(d.get("time") or os.stat(path).st_mtime)
        return {"evictor": str(d.get("evictor", "?")), "usage_bytes": int(d["usage_bytes"]),
                "capacity_bytes": int(d["capacity_bytes"]),
                "writers": int(d.get("writers", 0)), "time": published,
                "age_s": round(max(0.0, now - published), 3),
                "namespaces": {str(k): int(v) for k, v in d.get("namespaces", {}).items()}}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return {"error": f"{path}: unreadable ({e})"}


def tenant_usage(blocks, storage, names=()) -> list[dict]:
    """Blocks and bytes of each tenant account (the tag its keys carry:
    dualpath/kv/prefix.py), most bytes first; named where ``names``, the config's
    ``storage.tenant_quotas`` or the default tenant ("") name its tag; with its quota."""
    known = {tenant_tag(n): n for n in [*storage.tenant_quotas, *names, ""]}
    quotas = storage.quotas()
    per: dict[int, list[int]] = {}
    for b in blocks:
        row = per.setdefault(key_tag(b.key), [0, 0])
        row[0] += 1
        row[1] += b.nbytes
    return [{"tag": f"{t:06x}", "tenant": known.get(t), "blocks": n, "bytes": size,
             "quota_bytes": quotas.of(t) or 0}
            for t, (n, size) in sorted(per.items(), key=lambda kv: -kv[1][1])]


def namespace_usage(ns: Namespace, storage, names=()) -> tuple[dict, list]:
    """A namespace's row of ``usage``, and its blocks."""
    with _open(ns, storage) as store:
        blocks = list(store.walk())
    quota = int(storage.namespace_quota_gib * 2**30)
    nbytes = sum(b.nbytes for b in blocks)
    return {"namespace": ns.name, "dir": str(ns.dir), "blocks": len(blocks),
            "bytes": nbytes, "tenants": tenant_usage(blocks, storage, names),
            "oldest_mtime": min((b.mtime for b in blocks), default=None),
            "newest_mtime": max((b.mtime for b in blocks), default=None),
            **_extras(ns.dir),
            "quota_bytes": quota,
            "used_fraction": round(nbytes / quota, 6) if quota else None}, blocks


def _usage(args) -> int:
    storage, root = _storage(args)
    now = time.time()
    names = args.tenant or ()
    for n in names:
        if len(n) > MAX_TENANT_CHARS:
            raise UsageError(f"--tenant: at most {MAX_TENANT_CHARS} characters")
    rows, every = [], []
    for ns in namespaces(root, args.namespace):
        row, blocks = namespace_usage(ns, storage, names)
        rows.append(row)
        every += blocks
    capacity = int(storage.capacity_gib * 2**30)
    nbytes = sum(r["bytes"] for r in rows)
    out = {"dir": str(root), "capacity_gib": storage.capacity_gib,
           "capacity_bytes": capacity, "bytes": nbytes,
           "used_fraction": round(nbytes / capacity, 6) if capacity else None,
           "tenants": tenant_usage(every, storage, names),
           "evictor": _publication(root, now), "namespaces": rows}
    if args.json:
        _print_json(out)
        return 0
    used = f" ({100 * out['used_fraction']:.1f}% used)" if capacity else ""
    print(f"store {root}: {len(rows)} namespace{'s' * (len(rows) != 1)}, "
          f"{fmt_bytes(nbytes)} of "
          f"{fmt_bytes(capacity) if capacity else 'unbounded'}{used}")
    if rows:
        print(f"{'namespace':<24} {'blocks':>8} {'bytes':>11} {'quota':>6}  "
              f"{'oldest':<19}  {'newest':<19} {'tmp':>5} {'corrupt':>7}")
    for r in rows:
        used = f"{100 * r['used_fraction']:.1f}%" if r["used_fraction"] is not None else "-"
        print(f"{r['namespace']:<24} {r['blocks']:>8} {fmt_bytes(r['bytes']):>11} "
              f"{used:>6}  {_fmt_time(r['oldest_mtime']):<19}  "
              f"{_fmt_time(r['newest_mtime']):<19} {r['temp_files']:>5} "
              f"{r['corrupt_files']:>7}")
    for t in out["tenants"]:
        name = "(default)" if t["tenant"] == "" else t["tenant"] or "?"
        quota = f", quota {fmt_bytes(t['quota_bytes'])}" if t["quota_bytes"] else ""
        print(f"  tenant {name} (tag {t['tag']}): {t['blocks']} blocks, "
              f"{fmt_bytes(t['bytes'])}{quota}")
    pub = out["evictor"]
    if pub is not None and "error" in pub:
        print(f"  evictor's publication {pub['error']}")
    elif pub is not None:
        print(f"  evictor {pub['evictor']} published {fmt_bytes(pub['usage_bytes'])} of "
              f"{fmt_bytes(pub['capacity_bytes'])}, {pub['age_s']:.0f} s ago")
    return 0


# --- evict ----------------------------------------------------------------------------
def _recency(store: BlockStore, prefix: bytes, events: list) -> tuple[int, int]:
    """Add ``store``'s blocks (W at their mtime) and the ledger's hits (H, a ``.hits``
    file's records at its mtime, in file order) to ``events``, keys prefixed by
    ``prefix``; (blocks, bytes)."""
    blocks = nbytes = 0
    for b in store.walk():
        events.append((b.mtime, 0, 0, prefix + b.key, b.nbytes))
        blocks += 1
        nbytes += b.nbytes
    tail = LedgerTail.of(store.dir, "hits")
    seq = len(events)
    for name, records in tail.poll():
        try:
            t = os.stat(os.path.join(tail.dir, name), follow_symlinks=False).st_mtime
        except FileNotFoundError:
            continue
        for op, _, key in records:
            if op == HIT:
                seq += 1
                events.append((t, 1, seq, prefix + key, 0))
    return blocks, nbytes


def lru_victims(events: list, target: int) -> list[tuple[bytes, int]]:
    """The least recently used of ``events``' blocks (least recent first) that leave
    at most ``target`` bytes, through the evictor's core."""
    events.sort(key=lambda ev: ev[:3])
    core = LruCore(max(1, target), high=1.0, low=1.0, lease_s=0.0)
    for t, kind, _, key, n in events:
        if kind == 0:
            core.wrote(key, n, t)
        else:
            core.hit(key, t)        # a hit on a block not (or no longer) here: ignored
    return core.victims(math.inf)


def _evict(args) -> int:
    target = parse_size(args.to, "--to")
    storage, root = _storage(args)
    picked = namespaces(root, args.namespace)
    rows = []
    with contextlib.ExitStack() as stack:
        stores = [stack.enter_context(_open(ns, storage)) for ns in picked]
        events: list = []
        sizes = [_recency(store, i.to_bytes(2, "big"), events)
                 for i, store in enumerate(stores)]
        victims = lru_victims(events, target)       # least recent of every namespace
        for i, (ns, store) in enumerate(zip(picked, stores)):
            mine = i.to_bytes(2, "big")
            removed, freed, gone = [], 0, 0
            for pkey, n in victims:
                if pkey[:2] != mine:
                    continue
                key = pkey[2:]
                if args.dry_run or store.delete(key):
                    removed.append((key, n))
                    freed += n
                else:
                    gone += 1            # went away meanwhile (another evictor, a scrub)
            blocks, nbytes = sizes[i]
            after = list(store.walk()) if not args.dry_run else None
            rows.append({"namespace": ns.name, "blocks_before": blocks,
                         "bytes_before": nbytes, "evicted": len(removed),
                         "evicted_bytes": freed, "already_gone": gone,
                         "blocks_after": len(after) if after is not None
                         else blocks - len(removed),
                         "bytes_after": sum(b.nbytes for b in after) if after is not None
                         else nbytes - freed,
                         "keys": [k.hex() for k, _ in removed]})
    total_after = sum(r["bytes_after"] for r in rows)
    if args.json:
        _print_json({"dir": str(root), "target_bytes": target, "dry_run": args.dry_run,
                     "bytes_after": total_after, "namespaces": rows})
        return 0
    verb = "would evict" if args.dry_run else "evicted"
    scope = f"namespace {args.namespace}" if args.namespace else \
        f"{len(rows)} namespace{'s' * (len(rows) != 1)} together"
    print(f"store {root}: target {fmt_bytes(target)} for {scope}"
          f"{' (dry run: nothing removed)' if args.dry_run else ''}; "
          f"{'would leave' if args.dry_run else 'now'} {fmt_bytes(total_after)}")
    for r in rows:
        print(f"{r['namespace']}: {verb} {r['evicted']} blocks, {fmt_bytes(r['evicted_bytes'])}"
              f"; {'would leave' if args.dry_run else 'now'} {r['blocks_after']} blocks, "
              f"{fmt_bytes(r['bytes_after'])}"
              + (f" ({r['already_gone']} already gone)" if r["already_gone"] else ""))
        if args.dry_run:
            for k in r["keys"][:_LIST_SHOWN]:
                print(f"  {k}")
            if len(r["keys"]) > _LIST_SHOWN:
                print(f"  ... {len(r['keys']) - _LIST_SHOWN} more (--json lists all)")
    return 0


# --- scrub ----------------------------------------------------------------------------
class _Bar:
    """blocks done / total and MB/s on stderr, redrawn at most every 0.2 s."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled = total, enabled
        self.t0 = time.monotonic()
        self.last = 0.0

    def show(self, label: str, done: int, nbytes: int, final: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not final and now - self.last < 0.2):
            return
        self.last = now
        rate = nbytes / 1e6 / max(now - self.t0, 1e-9)
        frac = done / self.total if self.total else 1.0
        fill = round(20 * frac)
        sys.stderr.write(f"\rscrub [{'#' * fill}{'.' * (20 - fill)}] {done}/{self.total} "
                         f"blocks {rate:8.1f} MB/s  {label}")
        if final:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _scrub(args) -> int:
    if not math.isfinite(args.rate) or args.rate < 0:
        raise UsageError(f"--rate {args.rate:g}: MB/s must be >= 0 (0 = no limit)")
    storage, root = _storage(args)
    key = storage.integrity_key()
    todo = []
    for ns in namespaces(root, args.namespace):
        profile = resolve_profile(ns)
        with _open(ns, storage) as lister:
            keys = [b.key for b in lister.walk()]
        todo.append((ns, profile, keys))
    progress = args.progress if args.progress is not None else sys.stderr.isatty()
    bar = _Bar(sum(len(k) for _, _, k in todo), progress)
    rate = args.rate * 1e6
    t0 = time.monotonic()
    done = read_bytes = 0
    rows = []
    for ns, profile, keys in todo:
        row = {"namespace": ns.name, "checked": 0, "ok": 0, "corrupt": [], "missing": 0,
               "errors": 0, "bytes": 0, "skipped": None}
        rows.append(row)
        if profile is None:
            if keys:
                row["skipped"] = (f"no block header of {ns.name} names its geometry "
                                  f"(tried {min(len(keys), _PROFILE_TRIES)}); not read")
                done += len(keys)
            continue
        with _open(ns, storage, profile, integrity_key=key) as store:
            buf = aligned_bytes(store.layout.full_bytes)
            for k in keys:
                st = store.stats
                corrupt, misses = st.corrupt_blocks, st.misses
                ok = store.read_into(k, buf)
                row["checked"] += 1
                if ok:
                    row["ok"] += 1
                    row["bytes"] += buf.size
                elif st.corrupt_blocks > corrupt:
                    row["corrupt"].append(k.hex())
                elif st.misses > misses:
                    row["missing"] += 1
                else:
                    row["errors"] += 1      # an I/O error, or a symlink in its place
                if ok or st.misses == misses:
                    read_bytes += buf.size  # what the disk gave (the limiter's count)
                done += 1
                bar.show(ns.name, done, read_bytes)
                if rate > 0:
                    ahead = read_bytes / rate - (time.monotonic() - t0)
                    if ahead > 0:
                        time.sleep(ahead)
    seconds = time.monotonic() - t0
    bar.show("done", done, read_bytes, final=True)
    bad = any(r["corrupt"] for r in rows) or any(r["skipped"] for r in rows)
    totals = {f: sum(r[f] for r in rows) for f in ("checked", "ok", "missing", "errors",
                                                   "bytes")}
    totals["corrupt"] = sum(len(r["corrupt"]) for r in rows)
    if args.json:
        _print_json({"dir": str(root), **totals, "seconds": round(seconds, 3),
                     "bytes_read": read_bytes,
                     "mb_per_s": round(read_bytes / 1e6 / seconds, 1) if seconds else None,
                     "namespaces": rows})
        return 1 if bad else 0
    print(f"store {root}: checked {totals['checked']} blocks ({fmt_bytes(totals['bytes'])} "
          f"good) in {seconds:.1f} s")
    print(f"{'namespace':<24} {'checked':>8} {'ok':>8} {'corrupt':>8} {'missing':>8} "
          f"{'errors':>7}")
    for r in rows:
        print(f"{r['namespace']:<24} {r['checked']:>8} {r['ok']:>8} {len(r['corrupt']):>8} "
              f"{r['missing']:>8} {r['errors']:>7}")
        for k in r["corrupt"]:
            print(f"  corrupt, quarantined: {k}")
        if r["skipped"]:
            print(f"  skipped: {r['skipped']}")
    return 1 if bad else 0


# --- sweep ----------------------------------------------------------------------------
def _sweep(args) -> int:
    storage, root = _storage(args)
    max_age = storage.temp_max_age_s if args.max_age is None else args.max_age
    if not math.isfinite(max_age) or max_age < 0:
        raise UsageError(f"--max-age {max_age:g}: seconds must be >= 0")
    rows = []
    for ns in namespaces(root, args.namespace):
        with _open(ns, storage) as store:
            removed = store.sweep_temp(max_age)
        rows.append({"namespace": ns.name, "removed": removed,
                     "temp_files_left": _extras(ns.dir)["temp_files"]})
    if args.json:
        _print_json({"dir": str(root), "max_age_s": max_age,
                     "removed": sum(r["removed"] for r in rows), "namespaces": rows})
        return 0
    print(f"store {root}: removed {sum(r['removed'] for r in rows)} temp files older than "
          f"{max_age:g} s")
    for r in rows:
        print(f"{r['namespace']:<24} removed {r['removed']:>6}, {r['temp_files_left']} left")
    return 0
