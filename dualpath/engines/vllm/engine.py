"""The node daemon's side of DualPath inside vLLM: the engine whose "HBM" is vLLM's own.

A vLLM instance beside the node runs DualPathConnector (dualpath/vllm/). Its worker
process registers vLLM's KV tensors with a transfer engine of its own and attaches here
(:meth:`VllmEngine.attach`), describing where every Layer Block lives in those tensors
(a :class:`~dualpath.kv.placement.KvPlacement`). From then on the daemon's DRAM buffer
and the worker's KV memory are two registered memories, and every load is the same
one-sided WRITE as a DE-buffer -> PE copy:

    Lookup   hit length from the store (chained token-id keys: any process finds it)
    Load     hit Full Blocks storage -> buffer (read queue, storage-NIC limiter); per
             layer buffer -> the worker's KV blocks; layer l announced as soon as its
             bytes landed. Missing or corrupt blocks are announced first and never
             written: vLLM recomputes them (its load-error hook).
    Save     buffer slots lent to the worker, which WRITEs each computed layer of its
             newly full blocks into them; on commit the daemon persists them to the
             store through the storage-NIC limiter, off the request's critical path.

Tensor parallelism: the t ranks of an instance attach as t workers. The node keeps the
canonical block (every KV head, the TP=1 order: dualpath/vllm/kv_tensors.py), whatever
the TP, so the store and the peers never see it; each rank is given its view of the
buffer (:meth:`KvPlacement.select`: its heads' segments of each block), loads write a
rank's segments into that rank, and a save completes once every rank's ended: the first
rank's BeginSave lends the slots, the others' join it, and it is committed only when all
committed (dropped when any dropped or never came).

The KV byte format, and so the store namespace and the DRAM pool, is fixed by the first
worker to attach (:class:`~dualpath.paths.kvspace.KvSpace`); a worker of another format
is refused. The namespace's directory keeps a manifest of its model and format, so a
restarted daemon answers lookups before the worker attached again (the worker attaches
again on its next load, which the daemon answers NOT_FOUND). Threads: the node's loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dualpath import fault_injection
from dualpath.aio import waited_out
from dualpath.buffers.pool import Reservation
from dualpath.buffers.region import PinnedRegion
from dualpath.buffers.shm import BufferOffer
from dualpath.engines.vllm.instance_cache import InstanceCache
from dualpath.engines.vllm.stage import Stage
from dualpath.errors import DualPathError, UsageError
from dualpath.kv.placement import KvFormat, KvPlacement
from dualpath.kv.prefix import KEY_BYTES
from dualpath.paths.kvspace import KvSpace
from dualpath.paths.layers import LocalArrivals
from dualpath.paths.pending import PendingBlocks
from dualpath.storage.config import StorageConfig
from dualpath.storage.ratelimit import RateLimiter
from dualpath.transfer import TransferEngine
from dualpath.transfer.kvio import write_layers

log = logging.getLogger("dualpath.node")

MANIFEST = "namespace.json"     # in a namespace's store directory: its model and format


def write_manifest(manifest: Path, data: dict) -> None:
    """Write a store namespace's manifest atomically. Every node sharing the store may
    write it at once (their workers attach together): each through a temporary file of
    its own, so none renames another's away (a shared name failed one node's Attach
    with FileNotFoundError, and its vLLM instance with it)."""
    tmp = manifest.with_name(f".{manifest.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        tmp.write_text(json.dumps(data))
        os.replace(tmp, manifest)
    finally:
        tmp.unlink(missing_ok=True)


class NotAttached(DualPathError):
    """No worker of that name (or no worker at all) is attached (NOT_FOUND)."""


class FormatConflict(DualPathError):
    """A worker's KV format differs from the one this node serves (FAILED_PRECONDITION)."""


class BufferBusy(DualPathError):
    """The DRAM buffer had no room in time (RESOURCE_EXHAUSTED); the caller skips it."""


def namespace_for(model_id: str, signature: str) -> str:
    """The store namespace of a model's KV in one format (<= 32 bytes, stable)."""
    h = hashlib.blake2b(f"{model_id}\0{signature}".encode(), digest_size=6).hexdigest()
    return f"vllm-{h}"


@dataclass(frozen=True)
class Worker:
    """One attached vLLM worker (one tensor-parallel rank)."""

    name: str                   # its transfer engine's name: its control address
    model_id: str
    tp_rank: int
    tp_size: int
    placement: KvPlacement
    host_memory: bool = False   # its KV is host memory: it can copy from a shared buffer
    prefix_caching: bool = False    # vLLM's own prefix cache is on
    # Where its segments sit in the canonical block, and that block's rows (() : whole).
    canonical: tuple[int, ...] = ()
    canonical_rows: tuple[int, ...] = ()

    def canonical_format(self) -> KvFormat:
        """The node's format: the canonical block this rank holds a part of."""
        f = self.placement.fmt
        if not self.canonical:
            return f
        rows = self.canonical_rows
        if len(self.canonical) != len(f.row_bytes) or \
                any(not 0 <= c < len(rows) or rows[c] != r
                    for c, r in zip(self.canonical, f.row_bytes)) or \
                len(set(self.canonical)) != len(self.canonical):
            raise UsageError(f"worker {self.name}: canonical segments {list(self.canonical)} "
                             f"of rows {list(rows)} do not place its format "
                             f"{f.signature()}")
        return KvFormat(f.layers, f.unit_tokens, tuple(rows), f.units)


@dataclass(frozen=True)
class LoadStep:
    """One progress message of a load: ``layers_done`` layers are in place for every
    block not in ``failed_blocks`` (indices into the load's keys)."""

    layers_done: int
    failed_blocks: tuple[int, ...] = ()
    complete: bool = False
    bytes_written: int = 0
    slots: tuple[int, ...] = ()      # worker_copies: the blocks' buffer slots
    load_id: int = 0
    hold_ms: int = 0


@dataclass(eq=False)              # one object per save: hashed by identity (close())
class _Save:
    save_id: int
    worker: str
    request_id: str
    keys: list[bytes]
    res: Reservation | None          # None only while its first rank waits for room
    deadline: float
    readers: int = 0                 # loads copying from its slots (they stay until 0)
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    stage: Stage | None = None       # a P/D prefill's save: its blocks go to the DE
    held: bool = False               # adopted DE-buffer blocks: kept until released
    tail: bool = False               # its last key is a partial last block: never persisted
    ranks: int = 1                   # tensor-parallel ranks that save into it
    sids: dict[int, tuple[int, str]] = field(default_factory=dict)  # save id -> rank, worker
    ended: dict[int, bool] = field(default_factory=dict)            # rank -> committed
    begun: set[int] = field(default_factory=set)     # ranks that began it (or wait to)
    workers: set[str] = field(default_factory=set)   # every worker that began it
    # Set once its slots are lent (res), or failed: ranks that join while the first
    # one's reservation waits for room wait for it.
    lent: asyncio.Future | None = None

    def is_tail(self, i: int) -> bool:
        """Whether key ``i`` is the prompt's partial last block (never persisted)."""
        return self.tail and i == len(self.keys) - 1

    def flat(self, i: int) -> np.ndarray:
        """Block ``i``'s bytes (a holder of paths/pending.py)."""
        return self.res.flat(i)


class _InPlace:
    """A load's blocks that are all still in this node's write-back (a P/D request's
    adopted prompt, a save not yet persisted), served from their saves' own slots: no
    second reservation and no copy. ``slots``, ``flat(i)``, ``release()`` (idempotent)
    like a Reservation; each save keeps its slots until every such view let go.

    A decode node holds a request's prompt blocks from PrepareRequest until its
    decode instance has loaded them; a load that reserved a second copy of them waited
    for slots that only other such loads could free (hold and wait: K concurrent
    requests of P blocks stalled a pool of fewer than (K + 1) x P slots)."""

    def __init__(self, held: list[tuple[_Save, int]]):
        self.held = held
        self.slots = tuple(s.res.slots[j] for s, j in held)
        self.released = False
        for s, _ in held:
            s.readers += 1

    def __len__(self) -> int:
        return len(self.slots)

    def flat(self, i: int) -> np.ndarray:
        s, j = self.held[i]
        return s.res.flat(j)

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        for s, _ in self.held:
            s.readers -= 1
            if not s.readers:
                s.idle.set()


class VllmEngine:
    """See the module docstring. Create, serve (its gRPC edge is
    :class:`dualpath.node.servicers.KvConnectorServicer`), ``await close()``."""

    kind = "vllm"

    #: How long a worker_copies load's slots stay lent without EndLoad (its worker died):
    #: far past any worker's load timeout, after which the worker never copies.
    HOLD_S = 600.0

    def __init__(self, *, node_id: str, storage: StorageConfig, transfer: TransferEngine,
                 region: PinnedRegion, region_name: str, limiter: RateLimiter | None,
                 metrics, save_timeout_s: float = 120.0, max_blocks_per_call: int = 4096,
                 offer: BufferOffer | None = None):
        self.node_id = node_id
        self.storage = storage
        self.transfer = transfer
        self.region = region
        self.region_name = region_name
        self.limiter = limiter
        self.metrics = metrics
        self.save_timeout_s = save_timeout_s
        self.max_blocks_per_call = max_blocks_per_call
        self.space: KvSpace | None = None
        self.model_id = ""
        self.namespace = ""
        self.workers: dict[str, Worker] = {}
        self._saves: dict[int, _Save] = {}      # every rank's save id -> its save
        # Saves that ranks of a TP instance still join: (request, keys) -> the save.
        self._joining: dict[tuple[str, tuple[bytes, ...]], _Save] = {}
        self._live: set[_Save] = set()          # lent and not ended: what expiry sweeps
        self._views: dict[str, KvPlacement] = {}  # worker -> its view of the buffer
        # Committed blocks not on disk yet (write-back): lookups count them, loads copy
        # them from the save's slots instead of waiting for the store. The node's one
        # index of them (paths/pending.py; its KvSpace's once one is open): P/D requests
        # that share a prefix each hold its blocks (adopted) until their own decode
        # loaded them, so one leaving must not take the key from the others.
        self._pending = PendingBlocks()
        self._save_ids = itertools.count(1)
        self._persists: set[asyncio.Task] = set()
        self._warned_cap = False
        self.offer = offer                     # the buffer, shared with same-host workers
        # worker_copies loads: (slots, deadline, the worker that holds them)
        self._held: dict[int, tuple[Reservation, float, str]] = {}
        self._load_ids = itertools.count(1)
        # P/D prefills this node drives: request -> its staged hit (dualpath/node/
        # vllm_stage.py), found only with the request's ticket.
        self.stages: dict[str, Stage] = {}
        #: What the attached instance's own prefix cache likely holds (None: its prefix
        #: cache is off, or no worker attached): instance_cache.py.
        self.instance_cache: InstanceCache | None = None
        #: Requests this node's decode drives -> their cache salt: the blocks the
        #: instance loads or saves for them count in ``instance_cache`` under it.
        self.salts: dict[str, str] = {}
        self.attached = asyncio.Event()        # a worker attached (the KV space exists)
        self._bad_tickets = 0

    def describe(self) -> str:
        if self.space is None:
            return "vllm (no worker attached yet)"
        return (f"vllm (model {self.model_id}, {len(self.workers)} worker(s), KV format "
                f"{self.space.fmt.signature()}, store namespace {self.namespace})")

    @property
    def read_q_tokens(self) -> int:
        """The scheduler's read_q: this node's reads queued, in flight or expected.
        Write-back is not in it: it has the storage NIC's other direction (docs/vllm.md,
        "Write-back and reads at the storage NIC")."""
        return self.space.read_queue.read_q_tokens if self.space is not None else 0

    # ------------------------------------------------------------------ attach

    def _open_space(self, model_id: str, fmt: KvFormat) -> None:
        self.namespace = namespace_for(model_id, fmt.signature())
        self.model_id = model_id
        self.space = KvSpace.open(self.storage, self.namespace, fmt, region=self.region,
                                  region_name=self.region_name, limiter=self.limiter)
        # The DE read path's LOAD_HIT_KV reads (KvSpace.read) copy blocks still in this
        # node's write-back from DRAM, as the instance's own loads do: one index.
        self.space.pending = self._pending
        manifest = self.space.store.dir / MANIFEST
        if not manifest.exists():
            write_manifest(manifest, {"model_id": model_id, "format": {
                "layers": fmt.layers, "unit_tokens": fmt.unit_tokens,
                "row_bytes": list(fmt.row_bytes), "units": fmt.units}})
        log.info("%s: KV format %s of model %s: store namespace %s, %d buffer slots of "
                 "%d bytes", self.node_id, fmt.signature(), model_id, self.namespace,
                 self.space.pool.capacity, self.space.layout.full_bytes)

    def _restore(self, model_id: str) -> None:
        """After a restart, before any worker attached again: find the namespace a
        worker of ``model_id`` used (its manifest), so lookups hit at once."""
        for manifest in sorted(self.storage.resolved_dir().glob(f"vllm-*/{MANIFEST}")):
            try:
                m = json.loads(manifest.read_text())
                if m.get("model_id") != model_id:
                    continue
                f = m["format"]
                fmt = KvFormat(int(f["layers"]), int(f["unit_tokens"]),
                               tuple(int(r) for r in f["row_bytes"]), int(f["units"]))
            except (OSError, ValueError, KeyError, TypeError, UsageError) as e:
                log.warning("%s: unreadable store manifest %s: %s", self.node_id, manifest, e)
                continue
            self._open_space(model_id, fmt)
            return

    def attach(self, worker: Worker) -> KvPlacement:
        """Admit ``worker``; its view of the node's buffer (the KV space's: store
        namespace, pool, canonical format)."""
        if not 0 <= worker.tp_rank < worker.tp_size:
            raise UsageError(f"worker {worker.name}: rank {worker.tp_rank} of "
                             f"{worker.tp_size}")
        fmt = worker.canonical_format()
        if self.space is None:
            self._open_space(worker.model_id, fmt)
        elif fmt != self.space.fmt or worker.model_id != self.model_id:
            raise FormatConflict(
                f"worker {worker.name} has model {worker.model_id} in KV format "
                f"{fmt.signature()}; this node serves {self.model_id} in "
                f"{self.space.fmt.signature()} (one model per node daemon)")
        # A worker of the same rank, or of another TP size, is of an instance started
        # again: the one it replaces is gone.
        for name in [n for n, x in self.workers.items()
                     if n != worker.name and (x.tp_rank == worker.tp_rank
                                              or x.tp_size != worker.tp_size)]:
            self._forget_worker(name, worker.name)
        self.workers[worker.name] = worker
        canonical = worker.canonical
        if canonical and fault_injection.active("tp_swap_ranks"):
            n = len(canonical)                  # the next rank's heads (a negative control)
            canonical = tuple((c + n) % len(fmt.row_bytes) for c in canonical)
        view = (self.space.buffer.select(canonical) if canonical else self.space.buffer)
        self._views[worker.name] = view
        # A worker that attaches is a new instance (or this daemon is new): what its
        # prefix cache holds is known from here on.
        self.instance_cache = (InstanceCache(worker.placement.num_units // fmt.units)
                               if worker.prefix_caching else None)
        self.attached.set()
        log.info("%s: vLLM worker %s attached (rank %d of %d%s, %d KV blocks of %d tokens)",
                 self.node_id, worker.name, worker.tp_rank, worker.tp_size,
                 f": {len(worker.canonical)} of the block's {len(fmt.row_bytes)} segments"
                 if worker.canonical else "", worker.placement.num_units, fmt.unit_tokens)
        return view

    def _forget_worker(self, name: str, successor: str) -> None:
        """``successor`` took the place of worker ``name`` (its instance was started
        again: that process is gone, and with it any WRITE of its): the saves lent to
        it and the loads it never ended give their slots back now, not after their
        deadlines (120 s, 600 s). A stage's slots went back only with them: a prefill
        instance killed mid-request left 18 of 136 PE-buffer slots taken (the idle
        invariant)."""
        del self.workers[name]
        self._views.pop(name, None)
        saves = {s for s in self._live if name in s.workers}
        for s in saves:
            self._drop_save(s)
        loads = [lid for lid, (_, _, w) in self._held.items() if w == name]
        for lid in loads:
            self.end_load(lid)
        log.info("%s: vLLM worker %s took the place of %s; %d saves and %d loads it left "
                 "open give their slots back", self.node_id, successor, name, len(saves),
                 len(loads))

    def _view(self, w: Worker) -> KvPlacement:
        """The buffer as worker ``w`` sees it: its rank's segments of every slot."""
        return self._views.get(w.name, self.space.buffer)

    def _worker(self, name: str) -> Worker:
        w = self.workers.get(name)
        if w is None:
            raise NotAttached(f"no vLLM worker {name!r} is attached to node {self.node_id}")
        return w

    def _check_keys(self, keys: Sequence[bytes], what: str) -> None:
        if len(keys) > self.max_blocks_per_call:
            raise UsageError(f"{what}: {len(keys)} blocks in one call; at most "
                             f"{self.max_blocks_per_call}")
        for i, k in enumerate(keys):
            if len(k) != KEY_BYTES:
                raise UsageError(f"{what}: block key {i} is {len(k)} bytes, not {KEY_BYTES}")

    # ------------------------------------------------------------------ lookup

    def stage_for(self, request_id: str, ticket: str) -> Stage | None:
        """The staged hit of ``request_id`` when ``ticket`` is its ticket."""
        if not request_id or not ticket:
            return None
        st = self.stages.get(request_id)
        if st is None or not st.admits(request_id, ticket):
            if st is not None:
                self._bad_tickets += 1
                log.warning("%s: a connector call for %s presented another ticket; "
                            "served from the store, not its staged KV", self.node_id,
                            request_id)
            return None
        return st

    def get_num_new_matched_tokens(self, model_id: str, keys: Sequence[bytes],
                                   request_id: str = "", ticket: str = ""
                                   ) -> tuple[int, int]:
        """How many leading ``keys`` the store holds (0 before a worker attached); for
        a staged P/D prefill (its ticket), the leading keys of its staged hit, and the
        leading prompt blocks its DE is not sent (else 0)."""
        self._check_keys(keys, "Lookup")
        if self.space is None:
            self._restore(model_id)
        if self.space is None or model_id != self.model_id:
            return 0, 0
        stage = self.stage_for(request_id, ticket)
        if stage is not None:
            first, n = stage.match(keys)
            hit = n if first == 0 else 0
            self.metrics.connector_lookups.inc()
            self.metrics.connector_lookup_hit_blocks.inc(hit)
            return hit, stage.unsent
        cap = self.space.pool.capacity
        hit = self.space.store.leading(keys[:cap], self._pending)
        if hit == cap < len(keys) and not self._warned_cap:
            self._warned_cap = True
            log.warning("%s: a hit longer than the DRAM buffer (%d blocks) was cut to it; "
                        "raise buffers.pe_buffer_mib to load more", self.node_id, cap)
        self.metrics.connector_lookups.inc()
        self.metrics.connector_lookup_hit_blocks.inc(hit)
        return hit, 0

    # ------------------------------------------------------------------ load

    def share_with(self, worker: Worker) -> tuple[str, bytes]:
        """(socket name, one-time token) for a worker that may map the buffer itself, or
        ("", b"") when it is not shared (no offer, or the worker's KV is GPU memory)."""
        if self.offer is None or not worker.host_memory:
            return "", b""
        return self.offer.name, self.offer.grant()

    async def start_load_kv(self, request_id: str, worker_name: str, keys: list[bytes],
                            units: list[int], worker_copies: bool = False,
                            ticket: str = "") -> AsyncIterator[LoadStep]:
        """Load ``keys`` into the worker's engine blocks ``units`` (units_per_block per
        key), layer by layer; yields progress (see :class:`LoadStep`). ``worker_copies``:
        only into the buffer; the last step names the slots, held until
        :meth:`end_load`. A staged P/D prefill's blocks (its ``ticket``) come from its
        stage, as they are staged."""
        w = self._worker(worker_name)
        space = self.space
        assert space is not None
        self._check_keys(keys, "Load")
        k = space.fmt.units
        if len(units) != len(keys) * k:
            raise UsageError(f"Load: {len(keys)} blocks need {len(keys) * k} engine blocks, "
                             f"got {len(units)}")
        for u in units:
            if not 0 <= u < w.placement.num_units:
                raise UsageError(f"Load: engine block {u} outside the worker's "
                                 f"{w.placement.num_units}")
        if not keys:
            yield LoadStep(space.fmt.layers, (), True, 0)
            return
        if worker_copies and self.offer is None:
            raise UsageError("Load: worker_copies, but this node shares no buffer")
        self._expire()
        stage = self.stage_for(request_id, ticket)
        first = 0
        if stage is not None:
            first, n = stage.match(keys)
            if n < len(keys):
                stage = None                     # not the staged blocks: read them
        in_place = None
        if stage is None and all(key in self._pending for key in keys):
            in_place = _InPlace([self._pending.serving(key) for key in keys])
            # A P/D prompt's partial last block (adopted, never stored: only here).
            self.metrics.partial_blocks_loaded.inc(
                sum(s.is_tail(j) for s, j in in_place.held))
        res = (stage.view(first, len(keys)) if stage is not None
               else in_place if in_place is not None
               else await space.pool.reserve(len(keys)))
        L, T = space.fmt.layers, space.fmt.block_tokens
        arrivals = LocalArrivals()               # layers in the buffer
        reader: asyncio.Task | None = None
        writer: asyncio.Task | None = None
        try:
            t0 = time.monotonic()
            if stage is not None:
                arrivals = stage.source
                ok, reader = await _staged(stage, first, len(keys))
            elif in_place is not None:
                ok, reader = len(keys), asyncio.ensure_future(_const(len(keys)))
                arrivals.landed(L)
            else:
                ok, reader = await self._start_read(
                    request_id, keys, res, arrivals,
                    zero_layer0=worker_copies and fault_injection.active("load_skip_layer"))
            failed = tuple(range(ok, len(keys)))
            yield LoadStep(0, failed)
            if worker_copies:
                # The bytes of a block this rank copies (its heads' share at TP > 1).
                f = self._view(w).fmt
                share = f.layers * f.units * f.unit_bytes
                lid = next(self._load_ids)
                self._held[lid] = (res, time.monotonic() + self.HOLD_S, w.name)
                held, res = res, None            # the worker gives it back (end_load)
                slots = tuple(held.slots)
                try:
                    for n in range(1, L + 1):
                        await arrivals.ready(n - 1)
                        last = n == L
                        if last:                 # the checksums: only once all is read
                            ok = min(ok, await reader)
                            failed = tuple(range(ok, len(keys)))
                        yield LoadStep(n, failed, last,
                                       ok * share if last else 0,
                                       slots, lid, int(self.HOLD_S * 1000))
                except BaseException:
                    # The worker sees the stream break and recomputes every block of the
                    # load, so what it may still copy from these slots is overwritten.
                    # The slots go back once the reads into them have ended.
                    await _stopped(reader)
                    self.end_load(lid)
                    raise
                self.metrics.connector_loaded_bytes.inc(ok * share)
            else:
                queue: asyncio.Queue[int] = asyncio.Queue()
                layers, skipped = list(range(L)), 0
                if fault_injection.active("load_skip_layer"):
                    layers, skipped = layers[1:], 1
                    queue.put_nowait(1)
                writer = asyncio.ensure_future(write_layers(
                    self.transfer, w.name, self._view(w),
                    space.buffer_units(res)[:ok * k],
                    w.placement, units[:ok * k], 0, ok * T,
                    on_layer=lambda n: queue.put_nowait(n + skipped), layers=layers,
                    source=arrivals))
                done = 0
                while done < L:
                    getter = asyncio.ensure_future(queue.get())
                    await asyncio.wait({getter, writer}, return_when=asyncio.FIRST_COMPLETED)
                    if not getter.done():
                        getter.cancel()
                        writer.result()          # raises the transfer's error
                        continue                 # finished: its last layers are queued
                    done = getter.result()
                    last = done == L
                    nbytes = 0
                    if last:
                        nbytes = writer.result()
                        ok = min(ok, await reader)
                        failed = tuple(range(ok, len(keys)))
                        self.metrics.connector_loaded_bytes.inc(nbytes)
                    yield LoadStep(done, failed, last, nbytes)
            self._instance_has(self.salts.get(request_id), keys[:ok])
            if failed:
                self.metrics.connector_load_failed_blocks.inc(len(failed))
                log.warning("%s: load of %s: %d of %d hit blocks missing or corrupt; vLLM "
                            "recomputes from block %d", self.node_id, request_id,
                            len(failed), len(keys), ok)
            log.debug("%s: load of %s: %d blocks, %d usable, %s, %.1f ms", self.node_id,
                      request_id, len(keys), ok,
                      "copied by the worker" if worker_copies else f"WRITE to {w.name}",
                      1e3 * (time.monotonic() - t0))
        finally:
            cancelled = False
            for t in (writer, reader):
                if t is not None:                # both wait for their I/O in flight
                    cancelled = await _stopped(t) or cancelled
            if res is not None:
                res.release()
            if cancelled:                        # the caller's, kept until the slots are
                raise asyncio.CancelledError     # back

    async def read_layered(self, request_id: str, keys: list[bytes], res: Reservation,
                           arrivals: LocalArrivals) -> tuple[int, asyncio.Task]:
        """Read ``keys`` into blocks ``[0, len(keys))`` of ``res`` layer by layer (a P/D
        prefill's own part of its hit): see :meth:`_start_read`."""
        return await self._start_read(request_id, keys, res, arrivals)

    async def _start_read(self, request_id: str, keys: list[bytes], res: Reservation,
                          arrivals: LocalArrivals, zero_layer0: bool = False
                          ) -> tuple[int, asyncio.Task]:
        """Bring ``keys`` into ``res``, layer by layer where the store can (so layer 0
        is in place after 1/L of the read and the rest overlaps the engine's compute).
        Returns the usable blocks known so far (a missing block ends them) and a task
        that reads on, announcing each layer to ``arrivals``, and ends with the usable
        blocks once every payload verified (a corrupt one ends them there)."""
        space = self.space
        copied = await self._copy_pending(keys, res)
        rest = [i for i in range(len(keys)) if i not in copied]
        if not space.store.layered():
            ok = await self._read_whole(request_id, keys, res, rest)
            self._inject(res, range(ok), zero_layer0)
            arrivals.landed(space.fmt.layers)

            async def done() -> int:
                return ok
            return ok, asyncio.ensure_future(done())
        layers = await space.read_queue.open_layers([keys[i] for i in rest],
                                                    request_id=request_id)
        ok = rest[layers.found] if layers.found < len(rest) else len(keys)
        reading = rest[:layers.found]
        lb = space.layout.layer_bytes
        pristine: dict[int, np.ndarray] = {}

        def landed(done: int) -> None:
            nonlocal pristine
            if done == 1:
                pristine = self._inject(res, reading, zero_layer0)
            self.metrics.read_bytes.inc(lb * len(reading))
            arrivals.landed(done)

        async def read_on() -> int:
            try:
                verified = await layers.run(
                    [res.flat(i) for i in reading], space.fmt.layers, lb, landed,
                    lambda j, full: self._as_read(full, pristine.get(reading[j])))
            except BaseException as e:
                arrivals.failed(f"reading hit blocks: {e}")
                raise
            bad = [i for i, v in zip(reading, verified) if not v]
            return min([ok, *bad])
        task = asyncio.ensure_future(read_on())
        # A task cancelled before it ran never enters run(): its blocks are closed and
        # its tokens leave read_q all the same.
        task.add_done_callback(lambda _: layers.close())
        return ok, task

    @staticmethod
    def _as_read(block: np.ndarray, layer0: np.ndarray | None) -> np.ndarray:
        """The block as storage gave it, for its checksum: under a fault, a copy with
        layer 0 as it was read (the fault stands for damage after the check)."""
        if layer0 is None:
            return block
        block = block.copy()
        block[:layer0.size] = layer0
        return block

    def _inject(self, res: Reservation, blocks, zero_layer0: bool) -> dict[int, np.ndarray]:
        """Negative controls (dualpath/fault_injection.py), once layer 0 is in the buffer: a bit
        flipped after the checksum passed; or (worker_copies) layer 0 as if never read.
        Layer 0 of each damaged block as it was read (for :meth:`_as_read`)."""
        flip = fault_injection.active("load_flip_byte")
        if not (flip or zero_layer0):
            return {}
        lb = self.space.layout.layer_bytes
        pristine = {}
        for i in blocks:
            pristine[i] = res.flat(i)[:lb].copy()
            if flip:
                res.flat(i)[7] ^= 0x80           # the sign of a float32: finite, wrong
            if zero_layer0:
                res.flat(i)[:lb] = 0             # the worker copies zeros
        return pristine

    def end_load(self, load_id: int) -> None:
        """The worker copied a worker_copies load: its slots go back (idempotent)."""
        held = self._held.pop(load_id, None)
        if held is not None:
            held[0].release()

    def _expire(self) -> None:
        """Take back the slots of worker_copies loads never ended (their worker died)."""
        now = time.monotonic()
        for lid in [lid for lid, (_, d, _) in self._held.items() if d < now]:
            log.warning("%s: load %d was never ended by its worker; slots taken back",
                        self.node_id, lid)
            self.end_load(lid)

    async def _copy_pending(self, keys: list[bytes], res: Reservation) -> set[int]:
        """Blocks of ``keys`` still waiting to be persisted, copied into ``res`` from
        their save's slots (held until the copies end); their indices."""
        copies = [(i, *self._pending.serving(k)) for i, k in enumerate(keys)
                  if k in self._pending]
        for _, s, _ in copies:
            s.readers += 1
        try:
            await asyncio.gather(*(asyncio.to_thread(np.copyto, res.flat(i), s.res.flat(j))
                                   for i, s, j in copies))
        finally:
            for _, s, _ in copies:
                s.readers -= 1
                if not s.readers:
                    s.idle.set()
        return {i for i, _, _ in copies}

    async def _read_whole(self, request_id: str, keys: list[bytes], res: Reservation,
                          rest: list[int]) -> int:
        """Whole-block reads of ``rest`` (a store whose layers are not O_DIRECT pages):
        the usable leading blocks."""
        if not rest:
            return len(keys)
        got = await self.space.read(request_id, [keys[i] for i in rest], res, rest)
        self.metrics.read_bytes.inc(got.nbytes)
        return rest[got.usable] if got.usable < len(rest) else len(keys)

    # ------------------------------------------------------------------ save

    async def begin_save(self, request_id: str, worker_name: str, keys: list[bytes],
                         wait_s: float = 5.0, ticket: str = "") -> tuple[int, list[int]]:
        """Lend buffer slots for ``keys``; (save id, slot per key). A staged P/D
        prefill's save (its ``ticket``) goes to its DE, not to the store. A rank of a TP
        instance joins the save another rank began for the same request and keys (the
        same slots: each rank WRITEs its heads' segments)."""
        w = self._worker(worker_name)
        self._check_keys(keys, "BeginSave")
        if not keys:
            raise UsageError("BeginSave: no blocks")
        self._expire_saves()
        space = self.space
        assert space is not None
        join = (request_id, tuple(keys))
        s = self._joining.get(join) if w.tp_size > 1 else None
        if s is not None and w.tp_rank not in s.begun:
            return await self._join_save(s, join, w)
        stage = self.stage_for(request_id, ticket)
        # Registered before any wait, so the other ranks' BeginSaves (they come together)
        # join it rather than lend slots of their own.
        s = _Save(0, worker_name, request_id, list(keys), None,
                  time.monotonic() + self.save_timeout_s, stage=stage, ranks=w.tp_size,
                  lent=asyncio.get_running_loop().create_future(), begun={w.tp_rank})
        if w.tp_size > 1:
            self._joining[join] = s
        try:
            at = stage.save_slots(keys) if stage is not None else None
            if at is not None:               # slots the request reserved with its hit
                s.res = stage.view(at, len(keys))
            else:
                try:
                    s.res = await asyncio.wait_for(space.pool.reserve(len(keys)), wait_s)
                except TimeoutError:
                    raise BufferBusy(f"no room for {len(keys)} blocks in "
                                     f"{self.region_name} within {wait_s:g} s") from None
        except BaseException as e:
            if self._joining.get(join) is s:
                del self._joining[join]
            s.lent.set_exception(e if isinstance(e, DualPathError)
                                 else BufferBusy(f"the save's first rank failed: {e!r}"))
            s.lent.exception()               # retrieved: joiners re-raise their own
            raise
        s.lent.set_result(None)
        self._live.add(s)
        return self._lend(s, w)

    async def _join_save(self, s: _Save, join, w: Worker) -> tuple[int, list[int]]:
        """Rank ``w`` joins save ``s`` another rank began (its slots, once lent)."""
        s.begun.add(w.tp_rank)
        s.workers.add(w.name)                   # before the wait: a forget finds it
        if len(s.begun) >= s.ranks and self._joining.get(join) is s:
            del self._joining[join]             # every rank has it
        await asyncio.shield(s.lent)
        if s.res is None or s.res.released:
            raise NotAttached(f"save of {s.request_id} ended while rank {w.tp_rank} joined")
        # A late rank's WRITEs get their own bound: the save outlives them.
        s.deadline = max(s.deadline, time.monotonic() + self.save_timeout_s)
        return self._lend(s, w)

    def _lend(self, s: _Save, w: Worker) -> tuple[int, list[int]]:
        sid = next(self._save_ids)
        if not s.save_id:
            s.save_id = sid
        s.sids[sid] = (w.tp_rank, w.name)
        s.workers.add(w.name)
        self._saves[sid] = s
        return sid, list(s.res.slots)

    def end_save(self, save_id: int, commit: bool) -> int:
        """Persist (commit) or drop a lent save; how many blocks were queued (0 until
        every rank of a TP instance ended it)."""
        s = self._saves.pop(save_id, None)
        if s is None:
            raise NotAttached(f"save {save_id} is unknown or expired")
        rank, _ = s.sids.pop(save_id)
        s.ended[rank] = commit
        if len(s.ended) < s.ranks:
            return 0                            # the other ranks' heads are not in yet
        self._live.discard(s)
        if self._joining.get((s.request_id, tuple(s.keys))) is s:
            del self._joining[(s.request_id, tuple(s.keys))]
        if not all(s.ended.values()):
            s.res.release()
            return 0
        if s.stage is not None:
            self._instance_has(s.stage.salt, s.keys)   # vLLM computed them
            s.stage.on_saved(s.keys, s.res)      # it owns the slots now
            return len(s.keys)
        self._instance_has(self.salts.get(s.request_id), s.keys)
        self._commit(s)
        return len(s.keys)

    def _instance_has(self, salt: str | None, keys: Sequence[bytes]) -> None:
        """The instance loaded or computed ``keys`` for a request of cache salt ``salt``
        (a staged prefill's, or a decode's in ``salts``; None: not a request this node
        drives): its prefix cache holds them now."""
        if self.instance_cache is not None and salt is not None and keys:
            self.instance_cache.add(salt, keys)

    def _commit(self, s: _Save) -> None:
        """``s``'s blocks count as stored (write-back) and are persisted in the
        background; its slots go back once persisted (and no load copies from them)."""
        for i, key in enumerate(s.keys):
            self._pending.add(key, s, i)
        self.metrics.connector_pending_blocks.set(len(self._pending))
        t = asyncio.ensure_future(self._persist(s))
        self._persists.add(t)
        t.add_done_callback(self._persists.discard)

    async def _persist(self, s: _Save) -> None:
        space = self.space
        assert space is not None
        try:
            for i, key in enumerate(s.keys):
                try:
                    # The file, not the index: a block the index wrongly lists as
                    # stored must be written again, or no later request hits it.
                    if s.is_tail(i) or space.store.on_disk(key):
                        continue
                    if self.limiter is not None:
                        # The NIC's write direction (ratelimit.RateLimiter: full
                        # duplex, so write-back never delays a read).
                        await self.limiter.acquire_write(space.layout.full_bytes)
                    if await space.store.awrite(key, s.res.flat(i)):
                        self.metrics.persisted.inc()
                        self.metrics.written_bytes.inc(space.layout.full_bytes)
                except DualPathError as e:   # disk full, I/O error: skip caching it
                    self.metrics.persist_failed.inc()
                    log.warning("%s: persisting a block of %s failed: %s", self.node_id,
                                s.request_id, e)
                finally:
                    if not s.held:
                        self._unpend(s, key)
        finally:
            while s.held:                 # adopted: the decode instance loads them first
                s.idle.clear()
                await s.idle.wait()
            for key in s.keys:
                self._unpend(s, key)
            while s.readers:              # a load still copies from these slots
                s.idle.clear()
                await s.idle.wait()
            s.res.release()

    def _unpend(self, s: _Save, key: bytes) -> None:
        """``s`` no longer holds ``key`` for lookups and loads (idempotent); another
        save that holds it, if any, does."""
        self._pending.remove(key, s)
        self.metrics.connector_pending_blocks.set(len(self._pending))

    def adopt(self, request_id: str, keys: list[bytes], res, tail: bool = False
              ) -> _Save:
        """A P/D request's prompt blocks, in DE-buffer slots ``res`` (block i in slot
        i): counted as committed saves (lookups hit them, loads copy them from DRAM) and
        persisted through the storage-NIC limiter like any save, but kept in DRAM until
        :meth:`release_adopted` (the decode instance loaded them). ``res`` is theirs.
        ``tail``: the last key is the prompt's partial last block (its key covers its
        own tokens only, so only a lookup of exactly that prompt finds it): served from
        DRAM like the others, never persisted."""
        self._check_keys(keys, "adopt")
        s = _Save(0, "", request_id, list(keys), res, float("inf"), held=True, tail=tail)
        self._commit(s)
        return s

    @staticmethod
    def release_adopted(s: _Save) -> None:
        """The adopted blocks may leave DRAM once persisted (idempotent)."""
        s.held = False
        s.idle.set()

    def _expire_saves(self) -> None:
        """Take back slots of saves never ended (their worker died). The deadline is far
        past any write timeout of the worker, so no WRITE of it is still in flight."""
        now = time.monotonic()
        late = {s for s in self._live if s.deadline < now}
        for s in late:
            log.warning("%s: save %d of %s (worker %s, %d of %d ranks ended) never ended; "
                        "slots taken back", self.node_id, s.save_id, s.request_id, s.worker,
                        len(s.ended), s.ranks)
            self._drop_save(s)

    def _drop_save(self, s: _Save) -> None:
        """Forget save ``s`` for every rank and give its slots back (idempotent)."""
        for sid in s.sids:
            self._saves.pop(sid, None)
        s.sids.clear()
        self._live.discard(s)
        key = (s.request_id, tuple(s.keys))
        if self._joining.get(key) is s:
            del self._joining[key]
        if s.res is not None:
            s.res.release()

    async def close(self) -> None:
        for s in list(self._pending.servers()):
            self.release_adopted(s)
        for t in list(self._persists):
            await asyncio.gather(t, return_exceptions=True)
        for s in self._live:
            s.res.release()
        self._live.clear()
        self._saves.clear()
        self._joining.clear()
        for lid in list(self._held):
            self.end_load(lid)
        if self.offer is not None:
            self.offer.close()
        if self.space is not None:
            await self.space.close()


async def _const(v: int) -> int:
    return v


async def _staged(stage: Stage, first: int, n: int) -> tuple[int, asyncio.Task]:
    """A load of blocks ``[first, first + n)`` of ``stage``: the usable ones known now,
    and a task ending with the usable ones once every staged read ended and verified."""
    def clamp(usable: int) -> int:
        return max(0, min(n, usable - first))

    async def usable() -> int:
        return clamp(await asyncio.shield(stage.usable))

    return clamp(await asyncio.shield(stage.first)), asyncio.ensure_future(usable())


async def _stopped(task: asyncio.Future) -> bool:
    """Cancel ``task`` (a read or write of a load) and wait until it has ended, its I/O in
    flight with it; its outcome retrieved. Whether the caller was cancelled meanwhile."""
    task.cancel()
    cancelled = await waited_out(task)
    if not task.cancelled():
        task.exception()
    return cancelled
