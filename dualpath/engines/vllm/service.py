"""The KvConnector gRPC service of a vLLM node: the steps its instance's connector
calls (Attach, Lookup, Load, EndLoad, BeginSave, EndSave), protobuf at this edge only.

Threads: the node's event loop.
"""

from __future__ import annotations

import grpc

from dualpath.engines.vllm.engine import (
    BufferBusy,
    FormatConflict,
    NotAttached,
    VllmEngine,
    Worker,
)
from dualpath.errors import DualPathError, TransferError, UsageError
from dualpath.kv import placement_wire
from dualpath.paths.auth import Callers
from dualpath.paths.errors import RequestFailed
from dualpath.storage.errors import StorageError
from dualpath.v1 import connector_pb2, connector_pb2_grpc


class KvConnectorServicer(connector_pb2_grpc.KvConnectorServicer):
    """The KvConnector service over a :class:`~dualpath.engines.vllm.engine.VllmEngine`:
    protobuf in, the engine's call, protobuf or a status code out. Only this node's own
    identity may call it (its vLLM instance runs the connector with the node's
    certificate)."""

    _STATUS = ((NotAttached, grpc.StatusCode.NOT_FOUND),
               (FormatConflict, grpc.StatusCode.FAILED_PRECONDITION),
               (BufferBusy, grpc.StatusCode.RESOURCE_EXHAUSTED),
               (UsageError, grpc.StatusCode.INVALID_ARGUMENT))

    def __init__(self, engine: VllmEngine, callers: Callers):
        self.engine, self.callers = engine, callers

    async def _abort(self, context, e: DualPathError):
        for cls, code in self._STATUS:
            if isinstance(e, cls):
                await context.abort(code, str(e))
        raise e

    async def Attach(self, request, context):
        await self.callers.require(context, own=True)
        try:
            placement = placement_wire.from_pb(request.placement, "Attach placement")
            worker = Worker(request.worker_name, request.model_id, request.tp_rank,
                            request.tp_size or 1, placement, request.host_memory,
                            request.prefix_caching, tuple(request.canonical_segments),
                            tuple(request.canonical_row_bytes))
            view = self.engine.attach(worker)
            shm_name, shm_token = self.engine.share_with(worker)
        except DualPathError as e:
            await self._abort(context, e)
        return connector_pb2.AttachResponse(
            node_id=self.engine.node_id, namespace=self.engine.namespace,
            transport=self.engine.transfer.transport,
            buffer=placement_wire.to_pb(view), block_tokens=view.fmt.block_tokens,
            shm_name=shm_name, shm_token=shm_token)

    async def Lookup(self, request, context):
        await self.callers.require(context, own=True)
        attached = bool(request.worker_name) and request.worker_name in self.engine.workers
        if not request.block_keys:          # a worker's heartbeat
            return connector_pb2.LookupResponse(hit_blocks=0, worker_attached=attached)
        try:
            hit, unsent = self.engine.get_num_new_matched_tokens(request.model_id, list(request.block_keys),
                                             request.request_id, request.ticket)
        except DualPathError as e:
            await self._abort(context, e)
        return connector_pb2.LookupResponse(hit_blocks=hit, worker_attached=attached,
                                            unsent_blocks=unsent)

    async def Load(self, request, context):
        await self.callers.require(context, own=True)
        try:
            async for step in self.engine.start_load_kv(request.request_id, request.worker_name,
                                               list(request.block_keys), list(request.units),
                                               request.worker_copies, request.ticket):
                yield connector_pb2.LoadProgress(
                    layers_done=step.layers_done, failed_blocks=list(step.failed_blocks),
                    complete=step.complete, bytes_written=step.bytes_written,
                    slots=list(step.slots), load_id=step.load_id, hold_ms=step.hold_ms)
        except DualPathError as e:
            if isinstance(e, (TransferError, StorageError, RequestFailed)):
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            await self._abort(context, e)

    async def EndLoad(self, request, context):
        await self.callers.require(context, own=True)
        self.engine.end_load(request.load_id)
        return connector_pb2.EndLoadResponse()

    async def BeginSave(self, request, context):
        await self.callers.require(context, own=True)
        try:
            sid, slots = await self.engine.begin_save(request.request_id, request.worker_name,
                                                      list(request.block_keys),
                                                      ticket=request.ticket)
        except DualPathError as e:
            await self._abort(context, e)
        return connector_pb2.BeginSaveResponse(save_id=sid, slots=slots)

    async def EndSave(self, request, context):
        await self.callers.require(context, own=True)
        try:
            self.engine.end_save(request.save_id, request.commit)
        except DualPathError as e:
            await self._abort(context, e)
        return connector_pb2.EndSaveResponse()
