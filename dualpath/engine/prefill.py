"""The PE side of a node: one prefill per assigned request (paper Fig. 4a/4b).

    assigned -> DE prepared (Node.PrepareRequest: DE-buffer slots)
      read side PREFILL: hit Full Blocks storage -> PE buffer; per layer PE buffer -> HBM
                         by a WRITE over the node's loopback connection
      read side DECODE:  Engine.SubmitTransferOrder(LOAD_HIT_KV) + WatchTransfers: the DE
                         writes each layer's hit blocks into our HBM (:class:`LayerWatch`)
      per layer: wait for its hit KV -> compute (cost-model time; miss-token KV from the
        synthetic generator written into HBM) -> WRITE that layer's KV (PE read: hit and
        miss; DE read: miss only) into the DE buffer; with layerwise prefill the next
        layer's transfers run while this layer computes
    -> Node.PrefillDone -> PREFILL_DONE reported (FAILED on any error: requeued)

Threads: the node's event loop only (see dualpath/engine/node.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from typing import TYPE_CHECKING

import grpc

from dualpath.engine.kvplan import Payload, block_spans, layer_runs
from dualpath.engine.state import RS_DECODE, RS_NONE, RS_PREFILL, Engine, RequestFailed, unix_now
from dualpath.kv import cost
from dualpath.v1 import engine_pb2, engine_pb2_grpc, node_pb2, node_pb2_grpc, scheduler_pb2

if TYPE_CHECKING:
    from dualpath.engine.node import NodeDaemon

log = logging.getLogger("dualpath.engine")


class PrefillPath:
    """The prefills running on a PE node; owned by its :class:`NodeDaemon`, whose
    storage reader, buffers, TransferEngine and metrics it uses."""

    def __init__(self, node: NodeDaemon):
        self.node = node
        self.tasks: dict[str, asyncio.Task] = {}    # request -> its prefill
        self._rr = itertools.count()

    def assign(self, e: Engine, a) -> None:
        """Start the prefill of assignment ``a`` on engine ``e`` (once per request)."""
        if a.request_id in self.tasks:
            return
        e.tokens[a.request_id] = a.prompt_tokens
        if a.read_side == RS_PREFILL:
            self.node.pending_reads[a.request_id] = a.hit_tokens
        self.tasks[a.request_id] = self.node.spawn(self._prefill(e, a))

    def cancel(self, rid: str) -> None:
        t = self.tasks.pop(rid, None)
        if t is not None:
            t.cancel()

    def _read_side(self, p: Payload, a) -> int:
        if a.hit_tokens == 0 or p.oracle or p.read_policy == "none":
            return RS_NONE
        if p.read_policy == "prefill":
            return RS_PREFILL
        if p.read_policy == "round_robin":
            return RS_PREFILL if next(self._rr) % 2 == 0 else RS_DECODE
        if a.read_side == scheduler_pb2.READ_SIDE_SPLIT:
            return RS_DECODE if a.decode_read_tokens >= a.prefill_read_tokens else RS_PREFILL
        return a.read_side if a.read_side in (RS_PREFILL, RS_DECODE) else RS_PREFILL

    async def _prefill(self, e: Engine, a) -> None:
        n = self.node
        rid = a.request_id
        t0 = time.monotonic()
        try:
            async with e.slots:
                await self._prefill_request(e, a)
            n.complete(rid, e, scheduler_pb2.COMPLETION_STAGE_PREFILL_DONE)
            n.metrics.phase_s.labels("prefill").observe(time.monotonic() - t0)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - any failure requeues the request
            log.warning("prefill of %s on %s failed: %s", rid, e.engine_id, err)
            n.metrics.requests.labels("prefill_failed").inc()
            # Free what the DE holds for it, and only then report: the retry's
            # PrepareRequest must not overtake this cancel.
            with contextlib.suppress(grpc.aio.AioRpcError):
                await engine_pb2_grpc.EngineStub(n.channels.channel(
                    a.decode_control_address)).CancelRequest(
                        engine_pb2.CancelRequestRequest(request_id=rid), timeout=1)
            n.complete(rid, e, scheduler_pb2.COMPLETION_STAGE_FAILED)
        finally:
            e.tokens.pop(rid, None)
            self.tasks.pop(rid, None)
            n.pending_reads.pop(rid, None)

    async def _prefill_request(self, e: Engine, a) -> None:
        n = self.node
        p = Payload.decode(a.payload)
        side = self._read_side(p, a)
        if side == RS_PREFILL:
            n.pending_reads[a.request_id] = int(a.hit_tokens)
        else:
            n.pending_reads.pop(a.request_id, None)
        T, LB, TB = n.layout.tokens, n.layout.layer_bytes, n.layout.token_bytes
        L = n.layout.layers
        rid, prompt, hit = a.request_id, int(a.prompt_tokens), int(a.hit_tokens)
        de = a.decode_control_address
        spans = block_spans(p.token_ids(prompt), T)
        nb, hit_blocks = len(spans), hit // T
        node = node_pb2_grpc.NodeStub(n.channels.channel(de))
        prep = await node.PrepareRequest(node_pb2.PrepareRequestRequest(
            request_id=rid, decode_engine_id=a.decode_engine_id,
            prefill_control_address=n.address, prompt_tokens=prompt, hit_tokens=hit,
            read_side=side, payload=a.payload), timeout=30)
        layer_s = cost.request_prefill_s(n.profile, hit, prompt - hit) / L
        layerwise = p.layerwise and n.ecfg.layerwise
        if p.oracle:
            for _ in range(L):
                async with e.gpu:
                    await asyncio.sleep(layer_s)
            await self._prefill_done(node, rid, e, 0, (0.0, 0.0))
            return
        de_off = list(prep.block_offsets_bytes)
        if len(de_off) != nb:
            raise RequestFailed(f"{rid}: the DE prepared {len(de_off)} blocks, {nb} needed")
        hbm = await e.hbm.reserve(nb)
        pebuf = None
        watch = None
        read_bytes, read_span = 0, (0.0, 0.0)
        arrivals: list[asyncio.Future] = []    # PE buffer -> HBM writes, per layer
        pushes: list[asyncio.Future] = []      # HBM -> DE buffer writes, per layer
        try:
            if side == RS_PREFILL and hit_blocks:
                pebuf = await n.pool.reserve(hit_blocks)
                read_bytes, read_span = await n.read_hit_blocks(
                    rid, [s.key for s in spans[:hit_blocks]],
                    [pebuf.flat(i) for i in range(hit_blocks)])

                def h2d(layer: int):
                    items = [(pebuf.offset(i) + layer * LB, hbm.offset(i) + layer * LB, LB)
                             for i in range(hit_blocks)]
                    return n.transfer.write(n.address, items, local="pe_buffer",
                                            remote=e.region)
                if layerwise:
                    arrivals = [asyncio.ensure_future(h2d(0))]
                else:
                    for layer in range(L):
                        await h2d(layer)
            elif side == RS_DECODE and hit_blocks:
                await n.transfer.connect(de)
                eng = engine_pb2_grpc.EngineStub(n.channels.channel(de))
                await eng.SubmitTransferOrder(engine_pb2.TransferOrder(
                    request_id=rid, kind=engine_pb2.TRANSFER_KIND_LOAD_HIT_KV,
                    source_engine_id=a.decode_engine_id, target_engine_id=e.engine_id,
                    block_keys=[s.key for s in spans[:hit_blocks]], first_token=0,
                    tokens=hit_blocks * T, layer_count=L,
                    target_slots=[engine_pb2.TargetSlot(region=e.region,
                                                        offset_bytes=hbm.offset(i),
                                                        length_bytes=n.layout.full_bytes)
                                  for i in range(hit_blocks)]), timeout=10)
                watch = LayerWatch(eng.WatchTransfers(
                    engine_pb2.WatchTransfersRequest(request_id=rid)))
                if not layerwise:
                    await watch.until(L)
            push_from = hit if side == RS_DECODE else 0
            for layer in range(L):
                if side == RS_PREFILL and hit_blocks and layerwise:
                    await arrivals[layer]
                    if layer + 1 < L:
                        arrivals.append(asyncio.ensure_future(h2d(layer + 1)))
                elif watch is not None:
                    await watch.until(layer + 1)
                async with e.gpu:
                    await asyncio.sleep(layer_s)
                    for b, s0, s1 in layer_runs(hit, prompt, T):
                        view = hbm.flat(b)[layer * LB + s0 * TB: layer * LB + s1 * TB]
                        n.synth.fill_layer(view, spans[b].key, layer, s0)
                items = [(hbm.offset(b) + layer * LB + s0 * TB,
                          de_off[b] + layer * LB + s0 * TB, (s1 - s0) * TB)
                         for b, s0, s1 in layer_runs(push_from, prompt, T)]
                push = n.transfer.write(de, items, local=e.region, remote="de_buffer")
                if layerwise:
                    pushes.append(asyncio.ensure_future(push))
                else:
                    await push
            if pushes:
                await asyncio.gather(*pushes)
        finally:
            if watch is not None:
                watch.cancel()
            # On a failure part way, writes of earlier layers may still read from hbm
            # (pushes) or land in it from pebuf (arrivals): let each finish or fail (bounded
            # by transfer.timeout_s) before those slots go to another request. Cancelling
            # them instead left the WRs running, and broke the shared loopback connection.
            pending = [f for f in (*arrivals, *pushes) if not f.done()]
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
            hbm.release()
            if pebuf is not None:
                pebuf.release()
        await self._prefill_done(node, rid, e, read_bytes, read_span)

    async def _prefill_done(self, node, rid: str, e: Engine, read_bytes: int,
                            span: tuple[float, float]) -> None:
        await node.PrefillDone(node_pb2.PrefillDoneRequest(
            request_id=rid, prefill_engine_id=e.engine_id, prefill_done_unix_s=unix_now(),
            prefill_node_id=self.node.node_id, prefill_read_bytes=read_bytes,
            read_start_unix_s=span[0], read_end_unix_s=span[1]), timeout=10)


class LayerWatch:
    """Consumes a WatchTransfers stream; ``await until(n)`` returns once n layers landed."""

    def __init__(self, call):
        self.call = call
        self.layers = 0
        self.error: str | None = None
        self.changed = asyncio.Event()
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        try:
            async for prog in self.call:
                self.layers = max(self.layers, prog.layers_done)
                self.changed.set()
        except grpc.aio.AioRpcError as e:
            self.error = f"{e.code().name} {e.details()}"
        if self.error is None and not self.layers:
            self.error = "transfer stream ended early"
        self.changed.set()

    async def until(self, n: int) -> None:
        while self.layers < n:
            if self.error is not None or self.task.done():
                raise RequestFailed(f"hit KV from the DE: {self.error or 'stream ended'}")
            self.changed.clear()
            await self.changed.wait()

    def cancel(self) -> None:
        self.call.cancel()
        self.task.cancel()
