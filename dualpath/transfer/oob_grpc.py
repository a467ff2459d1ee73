"""The out-of-band channel of the node daemons: TransferEngine connect requests carried by
the Engine service's ExchangeEndpoint RPC (engine.proto).

Peers are named by their control address (``host:port`` of their Engine service), so a
name is all it takes to reach one. The request and reply travel as
:func:`dualpath.transfer.oob.encode` bytes in ``DataPlaneEndpoint.endpoint``. A request
to a name this process serves (the node's own loopback connection) skips gRPC.

Threads: the daemon's event loop only.
"""

from __future__ import annotations

import dataclasses
import errno

import grpc

from dualpath import tls
from dualpath.errors import TransferError, UsageError
from dualpath.rpc import CHANNEL_OPTIONS
from dualpath.tls import TlsConfig
from dualpath.transfer import oob
from dualpath.v1 import engine_pb2, engine_pb2_grpc


class GrpcChannels:
    """One grpc.aio channel per peer address, made on first use (mutual TLS per ``tls``,
    or plaintext when it says so); loop-owned.

    Who answers at an address is checked once the scheduler said who must
    (:meth:`expect`, from an assignment: the DE's control address and the identity that
    registered its group); until then, any server with a certificate of the cluster's CA
    for that host name is taken. Only the scheduler's word sets an expectation: an
    address a peer names for itself (a PrepareRequest's) never does, or one node could
    make this one refuse another."""

    def __init__(self, tls_config: TlsConfig):
        self.tls = tls_config
        self._channels: dict[tuple[str, str], grpc.aio.Channel] = {}
        self._expect: dict[str, str] = {}          # address -> "role/name"

    def expect(self, address: str, identity: str) -> None:
        """Calls to ``address`` from now on need the server to be ``identity``."""
        if identity:
            self._expect[address] = identity

    def expected(self, address: str, expect: str = "") -> str:
        """Who must answer at ``address`` ("" : any server the CA signed for the host)."""
        return expect or self._expect.get(address, "")

    def channel(self, address: str, expect: str = "") -> grpc.aio.Channel:
        """The channel to ``address``; the server must be ``expect`` when given (a
        caller that knows from the scheduler whom one call is for), else whom
        :meth:`expect` named for the address, else anyone the CA signed for the host."""
        want = expect or self._expect.get(address, "")
        ch = self._channels.get((address, want))
        if ch is None:
            ch = tls.channel(address, self.tls, options=CHANNEL_OPTIONS, expect=want or None)
            self._channels[(address, want)] = ch
        return ch

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()


class GrpcOutOfBand(oob.OutOfBand):
    def __init__(self, channels: GrpcChannels, timeout_s: float = 10.0):
        self.channels = channels
        self.timeout_s = timeout_s
        self._handlers: dict[str, oob.Handler] = {}

    def serve(self, name: str, handler: oob.Handler) -> None:
        if name in self._handlers:
            raise UsageError(f"an engine named {name!r} is already served")
        self._handlers[name] = handler

    def unserve(self, name: str) -> None:
        self._handlers.pop(name, None)

    async def handle(self, data: bytes, peer: str | None = None) -> bytes:
        """The servicer side: decode a request, run the served engine's handler. ``peer``
        (the caller's certificate identity, when there is one) replaces the name the
        request gives itself: admissions are keyed by who called, not by who it says
        it is."""
        req = oob.decode(data)
        if not isinstance(req, oob.ConnectRequest) or not self._handlers:
            raise UsageError("ExchangeEndpoint: expected a connect request for a served engine")
        if peer is not None:
            req = dataclasses.replace(req, source=peer)
        handler = next(iter(self._handlers.values()))
        return oob.encode(await handler(req))

    def verified(self, peer: str, expect: str = "") -> str:
        if peer in self._handlers:
            return ""                   # ourselves, in process
        return self.channels.expected(peer, expect)

    async def request(self, peer: str, req: oob.ConnectRequest,
                      expect: str = "") -> oob.ConnectReply:
        local = self._handlers.get(peer)
        if local is not None:
            reply = oob.decode(oob.encode(await local(oob.decode(oob.encode(req)))))
        else:
            stub = engine_pb2_grpc.EngineStub(self.channels.channel(peer, expect))
            try:
                r = await stub.ExchangeEndpoint(engine_pb2.ExchangeEndpointRequest(
                    caller=engine_pb2.DataPlaneEndpoint(engine_id=req.source,
                                                        transport=req.transport,
                                                        endpoint=oob.encode(req))),
                    timeout=self.timeout_s)
            except grpc.aio.AioRpcError as e:
                want = self.channels.expected(peer, expect)
                if want and "Hostname Verification" in (e.details() or ""):
                    raise TransferError(f"the server at {peer} is not {want} (its "
                                        "certificate does not name it): no connection",
                                        errno=errno.EPERM) from None
                raise TransferError(f"peer {peer} unreachable for ExchangeEndpoint: "
                                    f"{e.code().name} {e.details()}",
                                    errno=errno.ECONNREFUSED) from None
            reply = oob.decode(r.callee.endpoint)
        if not isinstance(reply, oob.ConnectReply):
            raise TransferError(f"peer {peer} answered a non-reply", errno=errno.EPROTO)
        return reply
