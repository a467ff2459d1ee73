"""The node's gRPC edge: the Engine and Node services (protobuf in, a call on the
node's PE or DE path, protobuf or a status code out) and the server that carries them
with the standard health service."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from dualpath import rpc
from dualpath.engine.state import DECODE
from dualpath.errors import DualPathError
from dualpath.v1 import engine_pb2, engine_pb2_grpc, node_pb2, node_pb2_grpc

if TYPE_CHECKING:
    from dualpath.engine.node import NodeDaemon


def create_server(address: str, node: NodeDaemon
                  ) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """A grpc.aio server (not started) with the Engine, Node and health services of
    ``node`` bound to ``address`` (port 0 = a free port); the server, its port and its
    health servicer (NOT_SERVING until set)."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    engine_pb2_grpc.add_EngineServicer_to_server(EngineServicer(node), server)
    node_pb2_grpc.add_NodeServicer_to_server(NodeServicer(node), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = rpc.bind(server, address, "engine.control_listen")
    return server, port, health_servicer


class EngineServicer(engine_pb2_grpc.EngineServicer):
    def __init__(self, node: NodeDaemon):
        self.node = node

    async def ExchangeEndpoint(self, request, context):
        try:
            data = await self.node.oob.handle(request.caller.endpoint)
        except DualPathError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return engine_pb2.ExchangeEndpointResponse(callee=engine_pb2.DataPlaneEndpoint(
            engine_id=self.node.node_id, transport=self.node.transfer.transport,
            endpoint=data))

    async def SubmitTransferOrder(self, request, context):
        de = self.node.de
        st = de.requests.get(request.request_id)
        if request.kind != engine_pb2.TRANSFER_KIND_LOAD_HIT_KV:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                                "only LOAD_HIT_KV orders are executed by a DE")
        if st is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"request {request.request_id} was not prepared here")
        if len(request.target_slots) != len(request.block_keys):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "one target slot per block key is required")
        order_id = await de.accept_order(st, request)
        return engine_pb2.TransferOrderAccepted(order_id=order_id)

    async def WatchTransfers(self, request, context):
        st = self.node.de.requests.get(request.request_id)
        if st is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"request {request.request_id} is not here")
        sent = -1
        L = self.node.layout.layers
        while True:
            # Clear before looking: a layer that lands while we are suspended in the
            # yield below sets the event again, so no wake-up is lost.
            st.changed.clear()
            if st.load_error:
                await context.abort(grpc.StatusCode.ABORTED, st.load_error)
            if st.layers_done != sent:
                sent = st.layers_done
                yield engine_pb2.TransferProgress(request_id=st.request_id, layers_done=sent,
                                                  complete=sent == L)
                if sent == L:
                    return
                continue
            await st.changed.wait()

    async def CancelRequest(self, request, context):
        known = request.request_id in self.node.de.requests
        self.node.cancel(request.request_id)
        return engine_pb2.CancelRequestResponse(was_known=known)


class NodeServicer(node_pb2_grpc.NodeServicer):
    def __init__(self, node: NodeDaemon):
        self.node = node

    async def PrepareRequest(self, request, context):
        if self.node.role != DECODE:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "not a decode node")
        try:
            offs = await self.node.de.prepare(request)
        except DualPathError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return node_pb2.PrepareRequestResponse(block_offsets_bytes=offs)

    async def StorageReads(self, request, context):
        lim = self.node.limiter
        keys = sorted(lim.slots)
        return node_pb2.StorageReadsResponse(
            node_id=self.node.node_id, slot_s=lim.SLOT_S,
            slot_start_unix_s=[k * lim.SLOT_S for k in keys],
            slot_bytes=[lim.slots[k] for k in keys])

    async def PrefillDone(self, request, context):
        de = self.node.de
        st = de.requests.get(request.request_id)
        if st is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"request {request.request_id} is not here")
        de.start_decode(st, request)
        return node_pb2.PrefillDoneResponse()
