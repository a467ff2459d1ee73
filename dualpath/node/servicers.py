"""The node's gRPC edge: the Engine and Node services (protobuf in, a dataclass call on
the node's DE path, protobuf or a status code out), the KvConnector service of a vLLM
node, and the server that carries them with the standard health service.

A message of an older attempt than the one a DE holds for the request is refused with
ABORTED (the scheduler gave that execution up; docs/reliability.md); one for a request
(or a newer attempt) not prepared here is NOT_FOUND."""

from __future__ import annotations

import errno
import itertools
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from dualpath import rpc
from dualpath.buffers.pool import PoolTooSmall
from dualpath.engines.emulated.forward import STEPS_PER_ANSWER, PrefillForward
from dualpath.errors import DualPathError, TransferError
from dualpath.kv import placement_wire
from dualpath.node.holdings import Holdings
from dualpath.paths.auth import Callers
from dualpath.paths.decode import DecodePath, PrepareCall
from dualpath.paths.errors import NotYours, StaleAttempt
from dualpath.paths.payload import Payload
from dualpath.paths.peers import LoadOrder, PrefillReport, top_from_pb
from dualpath.v1 import (
    engine_pb2,
    engine_pb2_grpc,
    node_pb2,
    node_pb2_grpc,
)


def new_server(address: str, credentials: grpc.ServerCredentials | None = None,
               limits=None) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """A grpc.aio server (not started) with the standard health service, bound to
    ``address`` (port 0 = a free port; mutual TLS with ``credentials``): the server, its
    port and its health servicer (NOT_SERVING until set). Bound first, so its address
    can name the node; the node's services are added (:func:`add_services`) once made.
    Connections are bounded by ``limits`` (the [grpc] section: dualpath.rpc.
    server_options, whose keepalive allows the pings of our peers' channels)."""
    server = grpc.aio.server(options=rpc.server_options(limits))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = rpc.bind(server, address, "engine.control_listen", credentials)
    return server, port, health_servicer


def add_services(server: grpc.aio.Server, services) -> None:
    """Add ``(add_to_server, servicer)`` pairs, before the server starts."""
    for add, servicer in services:
        add(servicer, server)


#: ``stop(request_id, attempt, caller)``: the node stops the caller's attempt of a request
#: and returns once its tasks for it ended (True when it held it).
Stop = Callable[[str, int, object], Awaitable[bool]]


def engine_services(callers: Callers, oob, transfer, decode: DecodePath | None,
                    stop: Stop, limiter, holdings: Callable[[], Holdings],
                    forward: PrefillForward | None = None) -> list:
    """The Engine and Node services of a node."""
    return [(engine_pb2_grpc.add_EngineServicer_to_server,
             EngineServicer(callers, oob, transfer, decode, stop)),
            (node_pb2_grpc.add_NodeServicer_to_server,
             NodeServicer(callers, limiter, holdings, decode, forward))]


async def _no_decode(context, decode):
    if decode is None:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "not a decode node")


async def _state(context, decode: DecodePath, request_id: str, attempt: int):
    """The DE state a message of ``attempt`` is for, or the call aborted."""
    try:
        return decode.state(request_id, attempt)
    except StaleAttempt as e:
        await context.abort(grpc.StatusCode.ABORTED, str(e))
    except KeyError:
        await context.abort(grpc.StatusCode.NOT_FOUND,
                            f"request {request_id} (attempt {attempt}) is not here")


class EngineServicer(engine_pb2_grpc.EngineServicer):
    """Node-to-node calls: cluster nodes only (dualpath/paths/auth.py); a request's
    order, watch and cancel only from the node that prepared it."""

    def __init__(self, callers: Callers, oob, transfer, decode: DecodePath | None,
                 stop: Stop):
        self.callers, self.node_id = callers, callers.node_id
        self.oob, self.transfer = oob, transfer
        self.decode, self.stop = decode, stop

    async def ExchangeEndpoint(self, request, context):
        ident = await self.callers.require(context)
        try:
            data = await self.oob.handle(request.caller.endpoint,
                                         str(ident) if ident is not None else None)
        except DualPathError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return engine_pb2.ExchangeEndpointResponse(callee=engine_pb2.DataPlaneEndpoint(
            engine_id=self.node_id, transport=self.transfer.transport, endpoint=data))

    async def SubmitTransferOrder(self, request, context):
        await self.callers.require(context)
        await _no_decode(context, self.decode)
        st = self.decode.requests.get(request.request_id)
        await self.callers.require_owner(context, st.owner if st else None,
                                         request.request_id)
        if request.kind != engine_pb2.TRANSFER_KIND_LOAD_HIT_KV:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "only LOAD_HIT_KV orders exist")
        try:
            order = LoadOrder(request.request_id, list(request.block_keys),
                              request.target_peer,
                              placement_wire.from_pb(request.target, "order target"),
                              list(request.target_units), request.attempt,
                              int(request.first_block))
            await self.decode.accept_order(order)
        except StaleAttempt as e:
            await context.abort(grpc.StatusCode.ABORTED, str(e))
        except KeyError:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"request {request.request_id} was not prepared here")
        except TransferError as e:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED if e.errno == errno.EPERM
                                else grpc.StatusCode.UNAVAILABLE, str(e))
        except DualPathError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return engine_pb2.TransferOrderAccepted()

    async def WatchTransfers(self, request, context):
        await self.callers.require(context)
        await _no_decode(context, self.decode)
        st = await _state(context, self.decode, request.request_id, request.attempt)
        await self.callers.require_owner(context, st.owner, request.request_id)
        sent = -1
        L = self.decode.space.fmt.layers
        while True:
            # Clear before looking: a layer that lands while we are suspended in the
            # yield below sets the event again, so no wake-up is lost.
            st.changed.clear()
            if st.load_error:
                await context.abort(grpc.StatusCode.ABORTED, st.load_error)
            if st.layers_done != sent:
                sent = st.layers_done
                yield engine_pb2.TransferProgress(request_id=st.request_id, layers_done=sent,
                                                  complete=sent == L,
                                                  loaded_blocks=st.loaded_blocks)
                if sent == L:
                    return
                continue
            await st.changed.wait()

    async def CancelRequest(self, request, context):
        ident = await self.callers.require(context)
        st = self.decode.requests.get(request.request_id) if self.decode else None
        if st is not None:
            await self.callers.require_owner(context, st.owner, request.request_id)
        try:
            await self.stop(request.request_id, request.attempt, ident)
        except StaleAttempt as e:
            await context.abort(grpc.StatusCode.ABORTED, str(e))
        except NotYours as e:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
        return engine_pb2.CancelRequestResponse()


class NodeServicer(node_pb2_grpc.NodeServicer):
    """PrepareRequest and PrefillDone: cluster nodes, on their own requests;
    StorageReads, ForwardSteps and Holdings (figures): any cluster identity."""

    def __init__(self, callers: Callers, limiter, holdings: Callable[[], Holdings],
                 decode: DecodePath | None, forward: PrefillForward | None = None):
        self.callers, self.node_id = callers, callers.node_id
        self.limiter, self.decode, self.forward = limiter, decode, forward
        self.holdings = holdings

    async def Holdings(self, request, context):
        await self.callers.require(context, ("node", "admin", "client"))
        return self.holdings().to_pb()

    async def ForwardSteps(self, request, context):
        await self.callers.require(context, ("node", "admin", "client"))
        fw = self.forward
        if fw is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "no forward steps here (not an emulated prefill node)")
        return node_pb2.ForwardStepsResponse(
            node_id=self.node_id,
            steps=[node_pb2.ForwardStep(start_unix_s=s.start_unix_s,
                                        duration_s=s.duration_s,
                                        attention_s=list(s.attention_s),
                                        requests=list(s.requests), tokens=list(s.tokens),
                                        left_tokens=list(s.left_tokens))
                   for s in itertools.islice((s for s in fw.steps
                                              if s.start_unix_s >= request.since_unix_s),
                                             STEPS_PER_ANSWER)])

    async def PrepareRequest(self, request, context):
        ident = await self.callers.require(context)
        await _no_decode(context, self.decode)
        try:
            call = PrepareCall(request.request_id, request.decode_engine_id,
                               request.prefill_control_address, int(request.prompt_tokens),
                               int(request.hit_tokens),
                               Payload.decode(request.payload), ident, request.attempt,
                               int(request.decode_read_tokens))
            buffer, slots, held, base = await self.decode.prepare(call)
        except NotYours as e:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
        except StaleAttempt as e:
            await context.abort(grpc.StatusCode.ABORTED, str(e))
        except PoolTooSmall as e:       # no attempt can fit: the PE reports it final
            await context.abort(grpc.StatusCode.OUT_OF_RANGE, str(e))
        except DualPathError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if buffer is None:
            return node_pb2.PrepareRequestResponse()
        return node_pb2.PrepareRequestResponse(buffer=placement_wire.to_pb(buffer),
                                               slots=slots, held_blocks=held,
                                               first_slot_block=base)

    async def StorageReads(self, request, context):
        await self.callers.require(context, ("node", "admin", "client"))
        lim = self.limiter
        keys = sorted(lim.slots)
        return node_pb2.StorageReadsResponse(
            node_id=self.node_id,
            slot_start_unix_s=[k * lim.SLOT_S for k in keys],
            slot_bytes=[lim.slots[k] for k in keys])

    async def PrefillDone(self, request, context):
        await self.callers.require(context)
        await _no_decode(context, self.decode)
        st = await _state(context, self.decode, request.request_id, request.attempt)
        await self.callers.require_owner(context, st.owner, request.request_id)
        self.decode.start_decode(st, PrefillReport(
            request.request_id, request.prefill_engine_id, request.prefill_node_id,
            request.prefill_done_unix_s, int(request.prefill_read_bytes),
            (request.read_start_unix_s, request.read_end_unix_s), request.attempt,
            int(request.computed_from_tokens), int(request.kv_blocks),
            (int(request.first_token_id), float(request.first_token_logprob),
             bool(request.first_token_stops)) if request.has_first_token else None,
            top_from_pb(request.first_token_top)
            if request.has_first_token and request.HasField("first_token_top") else None,
            (request.assigned_unix_s, request.allocated_unix_s, request.staged_unix_s)))
        return node_pb2.PrefillDoneResponse()
