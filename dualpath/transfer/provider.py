"""The provider interface: what the TransferEngine needs from a transport.

A provider registers buffers, makes connections, and reports completions; it knows
nothing of peers, slicing, retries or timeouts (that is the engine's policy). Two exist:
:mod:`dualpath.transfer.tcp_provider` over :mod:`dualpath.tcp` and
:mod:`dualpath.transfer.verbs_provider` over :mod:`dualpath.verbs`.

Connecting is two-sided, as RC QPs need: the active side creates a
:class:`Connection` (in RESET) and sends its :meth:`Connection.endpoint` bytes over the
out-of-band channel; the passive side's :meth:`Provider.accept` prepares its half (a
verbs QP; nothing for TCP) and answers with its endpoint bytes; the active side then
calls :meth:`Connection.connect` with them. Recovery is the same exchange after
:meth:`Connection.reset`. Endpoint bytes are opaque to everyone but their provider.

Threads: ``post``, ``wait``, ``reset`` and closing a connection that carried items run on
the engine's data-path thread; ``connect`` and ``endpoint`` may run on another thread
while the data-path thread polls (nothing posts on a connection being connected);
``accept``, ``register``, ``wake`` and ``close`` are control calls.
"""

from __future__ import annotations

import errno
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

from dualpath.dp import WcStatus, WorkCompletion
from dualpath.errors import TransferError, UsageError

#: Admission bounds of the passive side: connections (QPs) one peer may have us make,
#: and peers we make them for (TransferConfig.connections_per_peer is at most 64).
MAX_CONNECTIONS_PER_PEER = 64
MAX_PEERS = 1024

#: Work completion statuses that blame one WRITE (its keys or range), not the path: the items
#: before it in the same connection did land (RC order), and retrying it cannot help.
ITEM_ERRORS = frozenset({WcStatus.LOC_PROT_ERR, WcStatus.REM_INV_REQ_ERR,
                         WcStatus.REM_ACCESS_ERR, WcStatus.REM_OP_ERR,
                         WcStatus.LOC_LEN_ERR})


def status_name(status: int) -> str:
    """``REM_ACCESS_ERR (10)`` for a WcStatus value, ``status 99`` for an unknown one."""
    try:
        return f"{WcStatus(status).name} ({status})"
    except ValueError:
        return f"status {status}"


class Admissions:
    """The passive side's book of peers admitted through the authenticated out-of-band
    exchange: a small integer tag per peer (the TCP engine's per-peer cap counts by it)
    and the bounds on peers and connections per peer. Control thread only."""

    def __init__(self, max_peers: int = MAX_PEERS,
                 per_peer: int = MAX_CONNECTIONS_PER_PEER):
        self.max_peers, self.per_peer = max_peers, per_peer
        self._tags: dict[str, int] = {}
        self._next = 0

    def admit(self, peer: str, index: int) -> int:
        """The peer's tag; TransferError(EPERM) past a bound (nothing is made)."""
        if not 0 <= index < self.per_peer:
            raise TransferError(f"peer {peer!r} asked for connection {index}; at most "
                                f"{self.per_peer} per peer", errno=errno.EPERM)
        tag = self._tags.get(peer)
        if tag is None:
            if len(self._tags) >= self.max_peers:
                raise TransferError(f"{len(self._tags)} peers admitted already (at most "
                                    f"{self.max_peers}); refusing {peer!r}",
                                    errno=errno.EPERM)
            self._next += 1
            tag = self._tags[peer] = self._next
        return tag

    def tag(self, peer: str) -> int:
        """The peer's tag, made when it has none (a grant may come before its connect)."""
        return self.admit(peer, 0)

    def forget(self, peer: str) -> None:
        self._tags.pop(peer, None)


@dataclass(frozen=True)
class RegionInfo:
    """What a peer needs to WRITE into one of our regions (sent over the OOB channel)."""

    addr: int
    length: int     # bytes
    rkey: int
    # Where the provider scopes by key (verbs): this peer WRITEs into the region only
    # through windows, ``(offset, length, rkey)`` rows sorted by offset, one per granted
    # run; ``rkey`` above then opens nothing for it (the target's NIC refuses it).
    windows: tuple[tuple[int, int, int], ...] = ()
    scoped: bool = False


class Region(Protocol):
    """A registered buffer (verbs MemoryRegion, TcpRegion)."""

    addr: int
    length: int
    lkey: int
    rkey: int

    def close(self) -> None: ...


class Connection(ABC):
    """One RC-like connection (a verbs QP or a TCP connection) of the active side.

    ``items`` is a native ``struct dp_item`` array of ``max_send_wr`` entries that the
    engine fills before :meth:`post`; ``conn_id`` is what completions carry in qp_num.
    """

    conn_id: int
    max_send_wr: int
    items: object

    @abstractmethod
    def endpoint(self) -> bytes:
        """Our half's connection info for the peer (fresh after reset)."""

    @abstractmethod
    def connect(self, remote: bytes, timeout: float) -> None:
        """RESET -> connected to the peer's half described by ``remote``."""

    def connect_self(self) -> None:
        """RESET -> connected to this provider itself (only where ``Provider.copies_to_self``):
        a post then copies into our own regions, checked as a peer's target checks."""
        raise UsageError("this provider has no connection to itself")

    @abstractmethod
    def reset(self) -> None:
        """Any state -> RESET; outstanding items are dropped without completions."""

    @abstractmethod
    def post(self, count: int, signal_every: int) -> int:
        """Post ``items[:count]`` with one doorbell; return how many went out (fewer on
        the credit limit). A failed post raises PostError."""

    @abstractmethod
    def close(self) -> None: ...


class Provider(ABC):
    """A transport: regions, connections and one completion stream."""

    kind: str               # "verbs" | "tcp": the metric label and the log word
    description: str        # for start-up logs: device/port/GID or listen address
    poll_slice_s: float     # how long one wait() may block while items are in flight
    # A WRITE into our own regions is a copy on the data-path thread, no network stack
    # (Connection.connect_self); verbs keeps the NIC's loopback, as the CNIC does.
    copies_to_self: bool = False

    # Whether a region registered ``scoped`` takes a peer's WRITEs only inside windows
    # granted to that peer (:meth:`grant`); where False, ``scoped`` is accepted and
    # grants are no-ops (the region is as open to every admitted peer as any other).
    scopes: bool = False

    @abstractmethod
    def register(self, buf=None, *, addr: int | None = None,
                 length: int | None = None, scoped: bool = False) -> Region:
        """Register a buffer (or a raw range the caller keeps alive) for WRITE both ways;
        ``scoped``: peers WRITE into it only inside windows granted to them."""

    def grant(self, peer: str, region: Region, ranges) -> object | None:
        """Let ``peer`` (its admission name) WRITE into ``ranges`` (``(offset, length)``
        rows from the region's start) of the scoped ``region``; a handle for
        :meth:`ungrant` (None where the provider does not scope)."""
        return None

    def ungrant(self, grant: object) -> None:
        """End a grant: once this returns no byte of ``peer``'s lands in its windows."""

    def target_stats(self) -> dict[str, int]:
        """Counters of peers' WRITEs into our regions, where the provider sees them
        (``refused``, ``out_of_scope``); empty where the NIC keeps them (verbs)."""
        return {}

    def view(self, peer: str, region: Region) -> RegionInfo:
        """What ``peer`` is told of ``region`` by the out-of-band exchange: its address,
        length and key; where grants are keys of their own (verbs), the windows granted
        to that peer now."""
        return RegionInfo(region.addr, region.length, region.rkey)

    def trust(self, peer: str) -> None:
        """``peer`` is our own (the node's vLLM worker, with the node's certificate): its
        connections from now on are not scoped."""

    def register_gpu(self, addr: int, length: int, device: int) -> Region:
        """Register device memory ``[addr, addr + length)`` of GPU ``device`` (owned by the
        caller) for WRITE both ways; providers that cannot reach GPU memory refuse."""
        raise UsageError(f"the {self.kind} provider cannot register GPU memory; GPU KV needs "
                         "transport.kind = 'verbs' on a NIC with dma-buf or peer memory")

    @abstractmethod
    def connection(self, max_send_wr: int) -> Connection:
        """A new active-side connection in RESET."""

    @abstractmethod
    def accept(self, peer: str, index: int, remote: bytes) -> bytes:
        """Passive side: make (or reset and remake) our half of the peer's connection
        ``index`` towards ``remote``; return our endpoint bytes."""

    @abstractmethod
    def forget(self, peer: str) -> None:
        """Passive side: drop what accept() made for ``peer``."""

    @abstractmethod
    def wait(self, timeout: float) -> list[WorkCompletion]:
        """Completions of every connection, waiting up to ``timeout`` seconds for one
        (returns early, possibly empty, after wake())."""

    @abstractmethod
    def wake(self) -> None:
        """Make a wait() in progress return soon. Any thread."""

    @abstractmethod
    def close(self) -> None: ...
