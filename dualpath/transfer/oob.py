"""The out-of-band channel: how two TransferEngines exchange connection endpoints and
region keys before (and after recovering) their data-plane connections.

One request/reply, always from the side that writes: :class:`ConnectRequest` names the
requester, its transport and its connections' endpoints (by index, so a recovery
exchange can redo just one); the peer prepares its halves and answers with a
:class:`ConnectReply` holding its endpoints and its regions' keys (fresh each time, so
a recovery also refreshes stale rkeys). Messages encode to bytes for channels that cross
processes (:func:`encode`, :func:`decode`); the gRPC control plane carries those bytes.

:class:`InProcessChannel` connects engines that share one event loop (tests, the demo).
"""

from __future__ import annotations

import errno
import json
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from dualpath.errors import TransferError, UsageError
from dualpath.transfer.provider import RegionInfo


@dataclass(frozen=True)
class ConnectRequest:
    source: str                         # the requesting engine's name
    transport: str                      # "verbs" | "tcp"; the peer refuses a mismatch
    indices: tuple[int, ...]            # which of the requester's connections
    endpoints: tuple[bytes, ...]        # their endpoints, in the same order


@dataclass(frozen=True)
class ConnectReply:
    transport: str
    endpoints: tuple[bytes, ...]        # the peer's halves, in the request's order
    regions: dict[str, RegionInfo] = field(default_factory=dict)


Handler = Callable[[ConnectRequest], Awaitable[ConnectReply]]


def encode(msg: ConnectRequest | ConnectReply) -> bytes:
    """JSON (endpoints as hex): small, versionable, readable in a packet dump."""
    if isinstance(msg, ConnectRequest):
        d = {"type": "connect_request", "source": msg.source, "transport": msg.transport,
             "indices": list(msg.indices), "endpoints": [e.hex() for e in msg.endpoints]}
    elif isinstance(msg, ConnectReply):
        d = {"type": "connect_reply", "transport": msg.transport,
             "endpoints": [e.hex() for e in msg.endpoints],
             "regions": {k: _region(r) for k, r in msg.regions.items()}}
    else:
        raise UsageError(f"cannot encode {type(msg).__name__}")
    return json.dumps(d, separators=(",", ":")).encode()


def decode(data: bytes) -> ConnectRequest | ConnectReply:
    try:
        d = json.loads(data)
        eps = tuple(bytes.fromhex(e) for e in d["endpoints"])
        if d["type"] == "connect_request":
            return ConnectRequest(str(d["source"]), str(d["transport"]),
                                  tuple(int(i) for i in d["indices"]), eps)
        if d["type"] == "connect_reply":
            regions = {str(k): _region_info(v) for k, v in d["regions"].items()}
            return ConnectReply(str(d["transport"]), eps, regions)
    except (ValueError, KeyError, TypeError) as e:
        raise UsageError(f"malformed out-of-band message: {e}") from e
    raise UsageError(f"unknown out-of-band message type {d.get('type')!r}")


def _region(r: RegionInfo) -> list:
    """``[addr, length, rkey]``, and the windows where the region is scoped by key."""
    if not r.scoped:
        return [r.addr, r.length, r.rkey]
    return [r.addr, r.length, r.rkey, [list(w) for w in r.windows]]


def _region_info(v: list) -> RegionInfo:
    if len(v) == 3:
        return RegionInfo(*(int(x) for x in v))
    addr, length, rkey, windows = v
    return RegionInfo(int(addr), int(length), int(rkey),
                      tuple((int(o), int(n), int(k)) for o, n, k in windows), True)


class OutOfBand(ABC):
    """Carries ConnectRequests to named engines. Called on the owner's event loop."""

    @abstractmethod
    async def request(self, peer: str, req: ConnectRequest, expect: str = "") -> ConnectReply:
        """Deliver ``req`` to the engine serving ``peer``; raise TransferError (with
        errno) when it cannot be reached, or (``expect``: an identity "role/name") when
        another identity serves it."""

    def verified(self, peer: str, expect: str = "") -> str:
        """Who answered a :meth:`request` to ``peer`` made with ``expect``, as far as the
        channel checked it ("": not checked; a channel without identities)."""
        return ""

    @abstractmethod
    def serve(self, name: str, handler: Handler) -> None:
        """Answer requests addressed to ``name`` with ``handler``."""

    @abstractmethod
    def unserve(self, name: str) -> None: ...


class InProcessChannel(OutOfBand):
    """Engines on one event loop, by name. Messages go through encode/decode so the
    byte form is what gets exercised."""

    def __init__(self):
        self._handlers: dict[str, Handler] = {}

    def serve(self, name: str, handler: Handler) -> None:
        if name in self._handlers:
            raise UsageError(f"an engine named {name!r} is already served on this channel")
        self._handlers[name] = handler

    def unserve(self, name: str) -> None:
        self._handlers.pop(name, None)

    async def request(self, peer: str, req: ConnectRequest, expect: str = "") -> ConnectReply:
        handler = self._handlers.get(peer)
        if handler is None:
            raise TransferError(f"peer {peer!r} is not reachable over the out-of-band "
                                "channel (no engine of that name)", errno=errno.ECONNREFUSED)
        reply = decode(encode(await handler(decode(encode(req)))))
        assert isinstance(reply, ConnectReply)
        return reply
