"""TransferEngine: batches of one-sided WRITEs to named peers, as single awaitables.

Policy over a :class:`~dualpath.transfer.provider.Provider` (verbs or TCP): buffers are
registered once under a name; peers are reached through an out-of-band channel
(:mod:`dualpath.transfer.oob`) that exchanges endpoints and region keys; a batch of
``(local_offset, remote_offset, length)`` items is cut into slices
(:func:`~dualpath.transfer.slices.plan_rows`: uint64 rows, filled into WRs by C at post
time), placed on the peer's connections (a small batch whole on one, a large one
spread over all), posted with selective signalling, and resolved when its last slice
completes.

Threads. The event loop that called :meth:`TransferEngine.start` owns the peer table,
connection set-up and recovery exchanges, and every future (this module). One data-path
thread owns everything that touches the provider's data path: posting, polling (the GIL
is released inside the C calls), per-connection FIFOs of in-flight slices, credits,
reset after an error (:class:`~dualpath.transfer.datapath.DataPath`). The loop talks to
it through typed commands plus a wake-up; it answers with batches of typed events
delivered by ``call_soon_threadsafe``. Blocking connects run on a small executor.

A connection's life (``Conn.state``, owned by the data-path thread):

    UP --error completion / failed post / timeout--> RECOVERING (reset at once; its
    in-flight slices go back to the peer's queue) --reconnected--> UP
    RECOVERING --recover_attempts failed--> DOWN --a new write needs it--> RECOVERING

A transfer's life: submitted -> slices queued -> posted -> every slice completed (the
future gets None) | a slice failed for good (TransferError naming the status) | the
bound passed (TransferTimeout; the connections carrying it are recovered) | the engine
closed (TransferError). Failed slices are retried up to ``max_retries`` times after
their connection recovers, except item errors (bad key or range: REM_ACCESS_ERR,
LOC_PROT_ERR, ...), which fail their transfer at once; the recovery exchange refreshes
the peer's region keys, so a stale rkey fails one transfer and the next succeeds.
"""

from __future__ import annotations

import asyncio
import errno
import logging
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Self

from dualpath.config_sections import KvLaneConfig, TransportConfig
from dualpath.errors import DualPathError, TransferError, TransferTimeout, UsageError
from dualpath.transfer.config import TransferConfig
from dualpath.transfer.datapath import (
    AddPeer,
    Cancel,
    Conn,
    ConnDown,
    ConnUp,
    DataPath,
    Discard,
    Event,
    Peer,
    Ran,
    Recover,
    Resolved,
    Stopped,
    Submit,
    Transfer,
)
from dualpath.transfer.oob import ConnectReply, ConnectRequest, OutOfBand
from dualpath.transfer.provider import (
    Connection,
    Provider,
    Region,
    RegionInfo,
)
from dualpath.transfer.slices import plan_rows, window_keys
from dualpath.transfer.transport import open_provider, select_transport

log = logging.getLogger("dualpath.transfer")



class Grant:
    """Windows of one of our scoped regions that one peer may WRITE into, until
    :meth:`close` (idempotent; once it returns, none of that peer's bytes lands in them).
    Owned by the request it was made for."""

    __slots__ = ("_engine", "_handle")

    def __init__(self, engine: TransferEngine, handle):
        self._engine, self._handle = engine, handle

    def close(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None and self._engine._state != "closed":
            self._engine.provider.ungrant(handle)


class TransferEngine:
    """WRITEs to peers by name. Create it, ``await start()`` (or ``async with``) on the
    loop that will call :meth:`write`, register buffers, write, ``await close()``.

    The engine owns ``provider`` and closes it. ``name`` is how peers address us on the
    out-of-band channel.
    """

    def __init__(self, name: str, provider: Provider, oob: OutOfBand,
                 config: TransferConfig | None = None):
        if not isinstance(name, str) or not name:
            raise UsageError(f"engine name must be a non-empty str, not {name!r}")
        self.name, self.provider, self.oob = name, provider, oob
        self.config = config or TransferConfig()
        #: "verbs" | "tcp": the transport label for metrics and logs.
        self.transport = provider.kind
        #: Data-path counters (read-only outside the data-path thread).
        self.stats: Counter[str] = Counter()
        self._state = "new"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._regions: dict[str, Region] = {}
        self._gpu: dict[str, int] = {}          # region -> GPU device, for device memory
        self._scoped: set[str] = set()          # regions registered scoped
        self._peers: dict[str, Peer] = {}
        self._connecting: dict[str, asyncio.Task] = {}
        self._recoveries: set[asyncio.Task] = set()
        self._connector = ThreadPoolExecutor(2, thread_name_prefix=f"dp-connect-{name}")
        self._stopping: set[Transfer] = set()     # given up, not yet stopped (loop)
        self._dp = DataPath(name, provider, self.config, self.stats)

    @classmethod
    def open(cls, name: str, oob: OutOfBand, *, transport: TransportConfig | None = None,
             transfer: TransferConfig | None = None,
             lane: KvLaneConfig | None = None) -> TransferEngine:
        """Choose the transport per config (logged), open its provider, build the engine."""
        transport = transport or TransportConfig()
        transfer = transfer or TransferConfig()
        provider = open_provider(select_transport(transport), transport, transfer, lane)
        return cls(name, provider, oob, transfer)

    # ------------------------------------------------------------------ loop side

    async def start(self) -> TransferEngine:
        if self._state != "new":
            raise UsageError(f"transfer engine {self.name} was already started")
        self._loop = asyncio.get_running_loop()
        # Our own connections (to ourselves, served in process: over TLS a peer's
        # request carries its certificate identity instead) are not scoped.
        self.provider.trust(self.name)
        self.oob.serve(self.name, self._handle_connect)
        self._dp.start(self._loop, self._deliver)
        self._state = "running"
        c = self.config
        log.info("transfer engine %s: transport %s (%s); %d connections per peer, slices "
                 "of %d bytes, %d credits each, signal every %d, timeout %.3g s",
                 self.name, self.transport, self.provider.description,
                 c.connections_per_peer, c.slice_bytes, c.max_send_wr, c.signal_every,
                 c.timeout_s)
        return self

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def register(self, name: str, buf=None, *, addr: int | None = None,
                 length: int | None = None, gpu_device: int | None = None,
                 scoped: bool = False) -> Region:
        """Register a buffer (or a raw range the caller keeps alive; device memory of GPU
        ``gpu_device`` when given) once, as ``name``: the source of our writes and a
        target of peers' writes; ``scoped``: of the writes of peers only those inside
        windows :meth:`grant` gave them (where the provider scopes). Loop thread."""
        if self._state not in ("new", "running"):
            raise UsageError(f"transfer engine {self.name} is closed")
        if name in self._regions:
            raise UsageError(f"a region named {name!r} is already registered")
        if gpu_device is not None:
            region = self.provider.register_gpu(addr, length, gpu_device)
            self._gpu[name] = gpu_device
        else:
            region = self.provider.register(buf, addr=addr, length=length, scoped=scoped)
            if scoped:
                self._scoped.add(name)
        self._regions[name] = region
        log.info("transfer engine %s: region %r, %d bytes", self.name, name, region.length)
        # Addresses help an attacker aim a WRITE: DEBUG only.
        log.debug("transfer engine %s: region %r at %#x", self.name, name, region.addr)
        return region

    def rekey(self, name: str) -> Region:
        """Register region ``name`` again, so its old keys are dead: a fence. A peer's
        WRITE still on its way with the old rkey is refused where it lands (and fails its
        transfer); the peer learns the new key at its next connect or recovery exchange.
        Writes of ours from this region that are in flight fail too. Loop thread."""
        old = self._regions.get(name)
        if old is None:
            raise UsageError(f"no region named {name!r} to rekey")
        addr, length = old.addr, old.length
        old.close()
        device = self._gpu.get(name)
        region = (self.provider.register_gpu(addr, length, device) if device is not None
                  else self.provider.register(addr=addr, length=length,
                                              scoped=name in self._scoped))
        self._regions[name] = region
        self.stats["rekeys"] += 1
        log.info("transfer engine %s: region %r rekeyed (fence)", self.name, name)
        return region

    def grant(self, peer: str, region: str, ranges) -> Grant:
        """Let ``peer`` (the name its connect came under: its certificate identity
        over TLS) WRITE into ``ranges`` (``(offset, length)`` rows) of our scoped region
        ``region`` until the grant is closed; its other WRITEs into that region are
        refused where they land (REM_ACCESS_ERR). A no-op grant where the provider does
        not scope. Loop thread."""
        r = self._regions.get(region)
        if r is None:
            raise UsageError(f"no region named {region!r} to grant")
        if region not in self._scoped or not len(ranges):
            return Grant(self, None)
        return Grant(self, self.provider.grant(peer, r, ranges))

    def trust(self, peer: str) -> None:
        """``peer`` is our own (the vLLM worker beside this node): no scope limits its
        WRITEs (it writes where our connector hands it slots). Before its connect."""
        self.provider.trust(peer)

    def scoped(self, region: str) -> bool:
        """Whether region ``region`` takes only granted WRITEs of peers."""
        return region in self._scoped and self.provider.scopes

    def region_infos(self) -> dict[str, RegionInfo]:
        return {n: RegionInfo(r.addr, r.length, r.rkey) for n, r in self._regions.items()}

    async def connect(self, peer: str, *, expect: str = "") -> None:
        """Connect to ``peer`` now (write() does it on first use); ``expect``: the
        identity ("role/name") that must serve it, checked by the out-of-band exchange
        (TransferError EPERM when another one does, or when we are connected to it
        already as another, or unchecked)."""
        p = await self._peer(peer, expect)
        if expect and p.identity != expect:
            raise TransferError(f"peer {peer!r} is connected as "
                                f"{p.identity or 'an unchecked identity'}, not {expect}",
                                errno=errno.EPERM)

    async def write(self, peer: str, items, *, local: str = "default",
                    remote: str = "default", timeout: float | None = None) -> None:
        """WRITE ``(local_offset, remote_offset, length)`` items from our region ``local``
        into ``peer``'s region ``remote``; return when every byte landed. Raises
        UsageError (bad items: nothing sent), TransferError (``.status``: the completion
        status) or TransferTimeout after ``timeout`` (default config.timeout_s) seconds."""
        self._check_running()
        region = self._regions.get(local)
        if region is None:
            raise UsageError(f"no local region named {local!r} (registered: "
                             f"{', '.join(map(repr, self._regions)) or 'none'})")
        bound = self.config.timeout_s if timeout is None else timeout
        if not bound > 0:
            raise UsageError(f"timeout must be > 0 seconds, not {timeout!r}")
        p = await self._peer(peer)
        info = p.regions.get(remote)
        if info is None:
            raise UsageError(f"peer {peer!r} has no region named {remote!r} (it has: "
                             f"{', '.join(map(repr, p.regions)) or 'none'})")
        rows = plan_rows(items, self.config.slice_bytes, region.length, info.length)
        if not len(rows):
            return
        rkeys = None
        if info.scoped:
            rkeys, inside = window_keys(info.windows, rows, info.rkey)
            if not inside:      # a grant newer than our copy of the windows? Once more.
                await self.rescope(peer)
                info = p.regions.get(remote, info)
                rkeys, inside = window_keys(info.windows, rows, info.rkey)
            if not inside:      # refused here: posted, it would break every connection
                raise TransferError(f"write to {peer!r}: bytes outside the windows its "
                                    f"region {remote!r} grants us (no grant covers them)",
                                    errno=errno.EPERM)
        t = Transfer(self._loop.create_future(), p, rows, region, remote, rkeys)
        # The bound is one timer on the loop (wait_for and shield cost two futures and
        # four callbacks a write); delivery cancels it.
        t.timer = self._loop.call_later(bound, self._expire, t, peer, bound)
        self._dp.command(Submit(t))
        try:
            await t.fut
        except asyncio.CancelledError:
            if t.fut.cancelled():       # our caller was cancelled (not the engine closing)
                t.timer.cancel()
                t.abandoned = True
                await self._stop(t)
            raise

    async def rescope(self, peer: str) -> None:
        """Fetch the windows ``peer`` grants us now, where its regions are scoped by key
        (verbs: a window is an rkey of its own). Call before writing under a grant made
        since our copy was fetched: a window of an ended grant may still be in it, and a
        new grant of the same slots has new keys. A no-op for a peer not yet connected
        (its connect fetches them) or whose regions are not scoped so. Loop thread."""
        p = self._peers.get(peer)
        if p is None or not any(i.scoped for i in p.regions.values()):
            return
        req = ConnectRequest(self.name, self.transport, (), ())
        seq = p.ask()
        try:
            reply = await self.oob.request(peer, req, p.identity)
        except (DualPathError, OSError) as e:
            raise TransferError(f"cannot fetch peer {peer!r}'s windows: {e}",
                                errno=getattr(e, "errno", 0) or 0) from e
        self._check_reply(peer, reply, 0)
        p.refresh(seq, reply.regions)
        self.stats["rescopes"] += 1

    def _expire(self, t: Transfer, peer: str, bound: float) -> None:
        """Loop: ``t`` is past its bound: the data-path thread stops it and recovers the
        connections carrying it, then its writer gets TransferTimeout."""
        if t.fut.done():
            return
        t.abandoned = True
        t.expired = TransferTimeout(
            f"write of {t.nbytes} bytes ({t.nslices} slices) to peer {peer!r} did not "
            f"complete within {bound:.3g} s", errno=errno.ETIMEDOUT)
        self._give_up(t, t.fut)

    async def _stop(self, t: Transfer) -> None:
        """Loop: stop a write whose awaiter was cancelled and return once the data-path
        thread has: the connections carrying it reset (a TCP connection closed abortively,
        a QP's work requests flushed), none of it queued. A cancelled writer may then say
        its writes ended (paths/fence.py) without waiting out the write's bound."""
        f = self._loop.create_future()
        self._give_up(t, f)
        await f

    def _give_up(self, t: Transfer, f: asyncio.Future) -> None:
        t.stopped = f
        if self._dp.dead is not None or self._state != "running":
            self._stopped(t)          # no data-path thread to ask; close() fails the rest
            return
        self._stopping.add(t)
        self._dp.command(Cancel(t))

    def _stopped(self, t: Transfer) -> None:
        """Loop: the data-path thread stopped ``t`` (or there is no thread any more)."""
        self._stopping.discard(t)
        f, t.stopped = t.stopped, None
        if f is None or f.done():
            return
        if t.expired is not None:
            f.set_exception(t.expired)
        else:
            f.set_result(None)

    async def close(self) -> None:
        """Fail what is in flight, stop the data-path thread, close connections, regions
        and the provider (newest first). Idempotent."""
        if self._state in ("closing", "closed"):
            return
        started = self._state == "running"
        self._state = "closing"
        if started:
            self.oob.unserve(self.name)
            for task in [*self._recoveries, *self._connecting.values()]:
                task.cancel()
            await asyncio.gather(*self._recoveries, *self._connecting.values(),
                                 return_exceptions=True)
            await self._dp.stop()
        # Nothing else runs now: connects in the executor finish within their bound.
        await asyncio.to_thread(self._connector.shutdown, True)
        self._deliver(self._dp.drain(TransferError(f"transfer engine {self.name} closed")))
        for t in list(self._stopping):   # the thread is gone: nothing of them in flight
            self._stopped(t)
        for p in reversed(list(self._peers.values())):
            for c in reversed(p.conns):
                c.conn.close()
        for region in reversed(list(self._regions.values())):
            region.close()
        self.provider.close()
        self._state = "closed"

    def _check_running(self) -> None:
        if self._dp.dead is not None:
            raise TransferError(f"transfer engine {self.name}: data-path thread failed: "
                                f"{self._dp.dead!r}")
        if self._state != "running":
            raise UsageError(f"transfer engine {self.name} is {self._state}, not running")

    async def _run_blocking(self, fn, *args):
        return await self._loop.run_in_executor(self._connector, fn, *args)

    async def _peer(self, name: str, expect: str = "") -> Peer:
        p = self._peers.get(name)
        if p is not None:
            return p
        task = self._connecting.get(name)
        if task is None:
            task = self._loop.create_task(self._connect_peer(name, expect))
            self._connecting[name] = task
            task.add_done_callback(lambda _: self._connecting.pop(name, None))
        return await asyncio.shield(task)

    def _check_reply(self, peer: str, reply: ConnectReply, n: int) -> None:
        if reply.transport != self.transport:
            raise TransferError(f"peer {peer!r} uses transport {reply.transport}, we use "
                                f"{self.transport}", errno=errno.EPROTONOSUPPORT)
        if len(reply.endpoints) != n:
            raise TransferError(f"peer {peer!r} answered {len(reply.endpoints)} endpoints "
                                f"for {n} connections", errno=errno.EPROTO)

    def _to_self(self, name: str) -> bool:
        """WRITEs to ``name`` land in our own regions and the provider copies them there
        without a network stack (no exchange: nothing outside this process is reached)."""
        return name == self.name and self.provider.copies_to_self

    async def _connect_peer(self, name: str, expect: str = "") -> Peer:
        n = self.config.connections_per_peer
        conns: list[Connection] = []

        def make() -> None:         # on the data-path thread; a Discard after it sees them
            for _ in range(n):
                conns.append(self.provider.connection(self.config.max_send_wr))
        try:
            await self._dp.call(make)
            if self._to_self(name):
                for c in conns:
                    c.connect_self()
                regions = self.region_infos()
            else:
                req = ConnectRequest(self.name, self.transport, tuple(range(n)),
                                     tuple(c.endpoint() for c in conns))
                reply = await self.oob.request(name, req, expect)
                self._check_reply(name, reply, n)
                await asyncio.gather(*(self._run_blocking(c.connect, ep,
                                                          self.config.connect_timeout_s)
                                       for c, ep in zip(conns, reply.endpoints)))
                regions = reply.regions
        except BaseException as e:
            # Connected sockets may already have events queued on the data-path thread's
            # completion stream: only that thread may close them.
            self._dp.command(Discard(conns))
            if isinstance(e, (DualPathError, OSError)):
                raise TransferError(f"cannot connect to peer {name!r}: {e}",
                                    errno=getattr(e, "errno", 0) or 0) from e
            raise
        p = Peer(name, dict(regions),
                 "" if self._to_self(name) else self.oob.verified(name, expect))
        p.conns = [Conn(p, i, c) for i, c in enumerate(conns)]
        self._peers[name] = p
        self._dp.command(AddPeer(p))
        log.info("transfer engine %s: connected to %s %s (%d connections; regions %s)",
                 self.name, name, "by copies in this process (no network stack)"
                 if self._to_self(name) else f"over {self.transport}", n,
                 ", ".join(p.regions) or "none")
        return p

    async def _handle_connect(self, req: ConnectRequest) -> ConnectReply:
        """The passive side of connect and recovery: prepare our halves, send our keys."""
        if req.transport != self.transport:
            raise TransferError(f"engine {self.name} uses transport {self.transport}; peer "
                                f"{req.source!r} asked for {req.transport}",
                                errno=errno.EPROTONOSUPPORT)
        eps = tuple(self.provider.accept(req.source, i, ep)
                    for i, ep in zip(req.indices, req.endpoints))
        # What this peer may WRITE: per peer where grants are keys (verbs' windows). A
        # request with no connections asks for just that (TransferEngine.rescope).
        return ConnectReply(self.transport, eps,
                            {n: self.provider.view(req.source, r)
                             for n, r in self._regions.items()})

    def _start_recovery(self, c: Conn) -> None:
        if self._state != "running":
            return
        task = self._loop.create_task(self._recover(c))
        self._recoveries.add(task)
        task.add_done_callback(self._recoveries.discard)

    async def _recover(self, c: Conn) -> None:
        p, attempts, delay = c.peer, self.config.recover_attempts, 0.05
        last: BaseException | None = None
        for attempt in range(1, attempts + 1):
            try:
                if attempt > 1:         # a half-made connect; nothing is posted on it
                    await self._dp.call(c.conn.reset)
                if self._to_self(p.name):
                    p.regions = self.region_infos()     # keys as they are now (a rekey)
                    c.conn.connect_self()
                else:
                    req = ConnectRequest(self.name, self.transport, (c.index,),
                                         (c.conn.endpoint(),))
                    seq = p.ask()
                    reply = await self.oob.request(p.name, req, p.identity)
                    self._check_reply(p.name, reply, 1)
                    p.refresh(seq, reply.regions)
                    await self._run_blocking(c.conn.connect, reply.endpoints[0],
                                             self.config.connect_timeout_s)
            except (DualPathError, OSError) as e:
                last = e
                log.warning("transfer engine %s: peer %s connection %d: reconnect attempt "
                            "%d/%d failed: %s", self.name, p.name, c.index, attempt,
                            attempts, e)
                if attempt < attempts:
                    await asyncio.sleep(delay)
                    delay = min(delay * 4, 2.0)
                continue
            log.info("transfer engine %s: peer %s connection %d recovered (attempt %d)",
                     self.name, p.name, c.index, attempt)
            self._dp.command(ConnUp(c))
            return
        self._dp.command(ConnDown(c, last))

    def _deliver(self, events: list[Event]) -> None:
        """Loop: act on a batch of data-path events."""
        for ev in events:
            match ev:
                case Resolved(t, exc):
                    if t.timer is not None:
                        t.timer.cancel()
                    if t.abandoned or t.fut.done():
                        continue
                    if exc is None:
                        t.fut.set_result(None)
                    else:
                        t.fut.set_exception(exc)
                case Recover(c):
                    self._start_recovery(c)
                case Stopped(t):
                    self._stopped(t)
                case Ran(fut, result, error):
                    if fut.done():
                        continue
                    if error is None:
                        fut.set_result(result)
                    else:
                        fut.set_exception(error)
