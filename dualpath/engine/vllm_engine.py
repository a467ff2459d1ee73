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

The KV byte format, and so the store namespace and the DRAM pool, is fixed by the first
worker to attach (:class:`~dualpath.engine.kvspace.KvSpace`); a worker of another format
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
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from dualpath import faults
from dualpath.buffers.pool import Reservation
from dualpath.buffers.region import PinnedRegion
from dualpath.engine.kvio import write_layers
from dualpath.engine.kvspace import KvSpace
from dualpath.errors import DualPathError, UsageError
from dualpath.kv.placement import KvFormat, KvPlacement
from dualpath.kv.prefix import KEY_BYTES
from dualpath.storage.config import StorageConfig
from dualpath.storage.ratelimit import RateLimiter
from dualpath.transfer import TransferEngine

log = logging.getLogger("dualpath.engine")

MANIFEST = "namespace.json"     # in a namespace's store directory: its model and format


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


@dataclass(frozen=True)
class LoadStep:
    """One progress message of a load: ``layers_done`` layers are in place for every
    block not in ``failed_blocks`` (indices into the load's keys)."""

    layers_done: int
    failed_blocks: tuple[int, ...] = ()
    complete: bool = False
    bytes_written: int = 0


@dataclass
class _Save:
    save_id: int
    worker: str
    request_id: str
    keys: list[bytes]
    res: Reservation
    deadline: float
    readers: int = 0                 # loads copying from its slots (they stay until 0)
    idle: asyncio.Event = field(default_factory=asyncio.Event)


class VllmEngine:
    """See the module docstring. Create, serve (its gRPC edge is
    :class:`dualpath.engine.servicers.KvConnectorServicer`), ``await close()``."""

    kind = "vllm"

    def __init__(self, *, node_id: str, storage: StorageConfig, transfer: TransferEngine,
                 region: PinnedRegion, region_name: str, limiter: RateLimiter | None,
                 metrics, save_timeout_s: float = 120.0, max_blocks_per_call: int = 4096):
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
        self._saves: dict[int, _Save] = {}
        # Committed blocks not on disk yet (write-back): lookups count them, loads copy
        # them from the save's slots instead of waiting for the store.
        self._pending: dict[bytes, tuple[_Save, int]] = {}
        self._save_ids = itertools.count(1)
        self._persists: set[asyncio.Task] = set()
        self._warned_cap = False

    def describe(self) -> str:
        if self.space is None:
            return "vllm (no worker attached yet)"
        return (f"vllm (model {self.model_id}, {len(self.workers)} worker(s), KV format "
                f"{self.space.fmt.signature()}, store namespace {self.namespace})")

    @property
    def read_q_tokens(self) -> int:
        return self.space.read_queue.read_q_tokens if self.space is not None else 0

    # ------------------------------------------------------------------ attach

    def _open_space(self, model_id: str, fmt: KvFormat) -> None:
        self.namespace = namespace_for(model_id, fmt.signature())
        self.model_id = model_id
        self.space = KvSpace.open(self.storage, self.namespace, fmt, region=self.region,
                                  region_name=self.region_name, limiter=self.limiter)
        manifest = self.space.store.dir / MANIFEST
        if not manifest.exists():
            tmp = manifest.with_suffix(".tmp")
            tmp.write_text(json.dumps({"model_id": model_id, "format": {
                "layers": fmt.layers, "unit_tokens": fmt.unit_tokens,
                "row_bytes": list(fmt.row_bytes), "units": fmt.units}}))
            os.replace(tmp, manifest)
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

    def attach(self, worker: Worker) -> KvSpace:
        """Admit ``worker``; the KV space (store namespace, pool) it will use."""
        if worker.tp_size != 1:
            raise UsageError(f"worker {worker.name}: tensor parallelism {worker.tp_size} is "
                             "not supported yet (one worker per instance)")
        fmt = worker.placement.fmt
        if self.space is None:
            self._open_space(worker.model_id, fmt)
        elif fmt != self.space.fmt or worker.model_id != self.model_id:
            raise FormatConflict(
                f"worker {worker.name} has model {worker.model_id} in KV format "
                f"{fmt.signature()}; this node serves {self.model_id} in "
                f"{self.space.fmt.signature()} (one model per node daemon)")
        self.workers[worker.name] = worker
        log.info("%s: vLLM worker %s attached (rank %d of %d, %d KV blocks of %d tokens)",
                 self.node_id, worker.name, worker.tp_rank, worker.tp_size,
                 worker.placement.num_units, fmt.unit_tokens)
        return self.space

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

    def lookup(self, model_id: str, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` the store holds (0 before a worker attached)."""
        self._check_keys(keys, "Lookup")
        if self.space is None:
            self._restore(model_id)
        if self.space is None or model_id != self.model_id:
            return 0
        hit = 0
        cap = self.space.pool.capacity
        for k in keys[:cap]:
            if k not in self._pending and not self.space.store.contains(k):
                break
            hit += 1
        if hit == cap < len(keys) and not self._warned_cap:
            self._warned_cap = True
            log.warning("%s: a hit longer than the DRAM buffer (%d blocks) was cut to it; "
                        "raise buffers.pe_buffer_mib to load more", self.node_id, cap)
        self.metrics.connector_lookups.inc()
        self.metrics.connector_lookup_hit_blocks.inc(hit)
        return hit

    # ------------------------------------------------------------------ load

    async def load(self, request_id: str, worker_name: str, keys: list[bytes],
                   units: list[int]) -> AsyncIterator[LoadStep]:
        """Load ``keys`` into the worker's engine blocks ``units`` (units_per_block per
        key), layer by layer; yields progress (see :class:`LoadStep`)."""
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
        t0 = time.monotonic()
        res = await space.pool.reserve(len(keys))
        queue: asyncio.Queue[int] = asyncio.Queue()
        writer: asyncio.Task | None = None
        try:
            t1 = time.monotonic()
            ok = await self._fill(request_id, keys, res)
            t2 = time.monotonic()
            log.debug("%s: load of %s: %d blocks, %d usable (buffer %.1f ms, read %.1f ms), "
                      "into engine blocks %s of %s", self.node_id, request_id, len(keys), ok,
                      1e3 * (t1 - t0), 1e3 * (t2 - t1), units[:8], w.name)
            failed = tuple(range(ok, len(keys)))
            if failed:
                self.metrics.connector_load_failed_blocks.inc(len(failed))
                log.warning("%s: load of %s: %d of %d hit blocks missing or corrupt; vLLM "
                            "recomputes from block %d", self.node_id, request_id,
                            len(failed), len(keys), ok)
            yield LoadStep(0, failed)
            if faults.active("load_flip_byte"):
                for i in range(ok):
                    res.flat(i)[7] ^= 0x80     # the sign of a float32: finite, wrong
            layers = list(range(space.fmt.layers))
            skipped = 0
            if faults.active("load_skip_layer"):
                layers, skipped = layers[1:], 1
                queue.put_nowait(1)
            writer = asyncio.ensure_future(write_layers(
                self.transfer, w.name, space.buffer, space.buffer_units(res)[:ok * k],
                w.placement, units[:ok * k], 0, ok * space.fmt.block_tokens,
                on_layer=lambda n: queue.put_nowait(n + skipped), layers=layers))
            done = 0
            while done < space.fmt.layers:
                getter = asyncio.ensure_future(queue.get())
                await asyncio.wait({getter, writer}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    writer.result()            # raises the transfer's error
                    continue                   # finished: its last layers are queued
                done = getter.result()
                last = done == space.fmt.layers
                nbytes = writer.result() if last else 0
                if last:
                    self.metrics.connector_loaded_bytes.inc(nbytes)
                    log.debug("%s: load of %s: %d layers written in %.1f ms", self.node_id,
                              request_id, done, 1e3 * (time.monotonic() - t2))
                yield LoadStep(done, failed, last, nbytes)
        finally:
            if writer is not None and not writer.done():
                writer.cancel()                # write_layers waits for writes in flight
                await asyncio.gather(writer, return_exceptions=True)
            res.release()

    async def _fill(self, request_id: str, keys: list[bytes], res: Reservation) -> int:
        """Bring ``keys`` into ``res``: blocks still waiting to be persisted are copied
        from their save's slots, the rest read from the store. How many leading blocks
        are usable (a missing or corrupt one ends them)."""
        space = self.space
        copies = [(i, *self._pending[k]) for i, k in enumerate(keys) if k in self._pending]
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
        copied = {i for i, _, _ in copies}
        rest = [i for i in range(len(keys)) if i not in copied]
        bad = len(keys)
        if rest:
            got = await space.read(request_id, [keys[i] for i in rest], res, rest)
            self.metrics.read_bytes.inc(got.nbytes)
            if got.usable < len(rest):
                bad = rest[got.usable]
        return bad

    # ------------------------------------------------------------------ save

    async def begin_save(self, request_id: str, worker_name: str, keys: list[bytes],
                         wait_s: float = 5.0) -> tuple[int, list[int]]:
        """Lend buffer slots for ``keys``; (save id, slot per key)."""
        self._worker(worker_name)
        self._check_keys(keys, "BeginSave")
        if not keys:
            raise UsageError("BeginSave: no blocks")
        self._expire_saves()
        space = self.space
        assert space is not None
        try:
            res = await asyncio.wait_for(space.pool.reserve(len(keys)), wait_s)
        except TimeoutError:
            raise BufferBusy(f"no room for {len(keys)} blocks in {self.region_name} within "
                             f"{wait_s:g} s") from None
        sid = next(self._save_ids)
        self._saves[sid] = _Save(sid, worker_name, request_id, list(keys), res,
                                 time.monotonic() + self.save_timeout_s)
        return sid, list(res.slots)

    def end_save(self, save_id: int, commit: bool) -> int:
        """Persist (commit) or drop a lent save; how many blocks were queued."""
        s = self._saves.pop(save_id, None)
        if s is None:
            raise NotAttached(f"save {save_id} is unknown or expired")
        if not commit:
            s.res.release()
            return 0
        for i, key in enumerate(s.keys):
            self._pending.setdefault(key, (s, i))
        self.metrics.connector_pending_blocks.set(len(self._pending))
        t = asyncio.ensure_future(self._persist(s))
        self._persists.add(t)
        t.add_done_callback(self._persists.discard)
        return len(s.keys)

    async def _persist(self, s: _Save) -> None:
        space = self.space
        assert space is not None
        try:
            for i, key in enumerate(s.keys):
                try:
                    if space.store.contains(key):
                        continue
                    if self.limiter is not None:
                        await self.limiter.acquire(space.layout.full_bytes)
                    if await space.store.awrite(key, s.res.flat(i)):
                        self.metrics.persisted.inc()
                except DualPathError as e:   # disk full, I/O error: skip caching it
                    self.metrics.persist_failed.inc()
                    log.warning("%s: persisting a block of %s failed: %s", self.node_id,
                                s.request_id, e)
                finally:
                    if self._pending.get(key, (None,))[0] is s:
                        del self._pending[key]
                    self.metrics.connector_pending_blocks.set(len(self._pending))
        finally:
            for key in s.keys:
                if self._pending.get(key, (None,))[0] is s:
                    del self._pending[key]
            self.metrics.connector_pending_blocks.set(len(self._pending))
            while s.readers:              # a load still copies from these slots
                s.idle.clear()
                await s.idle.wait()
            s.res.release()

    def _expire_saves(self) -> None:
        """Take back slots of saves never ended (their worker died). The deadline is far
        past any write timeout of the worker, so no WRITE of it is still in flight."""
        now = time.monotonic()
        for sid in [sid for sid, s in self._saves.items() if s.deadline < now]:
            s = self._saves.pop(sid)
            log.warning("%s: save %d of %s (worker %s) never ended; slots taken back",
                        self.node_id, sid, s.request_id, s.worker)
            s.res.release()

    async def close(self) -> None:
        for t in list(self._persists):
            await asyncio.gather(t, return_exceptions=True)
        for s in self._saves.values():
            s.res.release()
        self._saves.clear()
        if self.space is not None:
            await self.space.close()
