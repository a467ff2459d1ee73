"""TransferEngine: batches of one-sided WRITEs to named peers, as single awaitables.

Policy over a :class:`~dualpath.transfer.provider.Provider` (verbs or TCP): buffers are
registered once under a name; peers are reached through an out-of-band channel
(:mod:`dualpath.transfer.oob`) that exchanges endpoints and region keys; a batch of
``(local_offset, remote_offset, length)`` items is cut into slices
(:func:`~dualpath.transfer.plan.plan_rows`: uint64 rows, filled into WRs by C at post
time), placed on the peer's connections (a small batch whole on one, a large one
spread over all), posted with selective signalling, and resolved when its last slice
completes.

Threads. The event loop that called :meth:`TransferEngine.start` owns the peer table,
connection set-up and recovery exchanges, and every future. One data-path thread owns
everything that touches the provider's data path: posting, polling (the GIL is released
inside the C calls), per-connection FIFOs of in-flight slices, reset after an error. The
loop talks to it through a command deque plus a wake-up; it answers with batches of events
delivered by ``call_soon_threadsafe``. Blocking connects run on a small executor.

A connection's life (``_Conn.state``, owned by the data-path thread):

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
import threading
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple, Self

import numpy as np

from dualpath._native import ffi, lib
from dualpath.config_sections import KvLaneConfig, TransportConfig
from dualpath.dp import Completion, PostError, WcStatus
from dualpath.errors import DualPathError, TransferError, TransferTimeout, UsageError
from dualpath.transfer.config import TransferConfig
from dualpath.transfer.oob import ConnectReply, ConnectRequest, OutOfBand
from dualpath.transfer.plan import plan_rows, spread
from dualpath.transfer.provider import (
    ITEM_ERRORS,
    Connection,
    Provider,
    Region,
    RegionInfo,
    status_name,
)
from dualpath.transfer.transport import open_provider, select_transport

log = logging.getLogger("dualpath.transfer")

UP, RECOVERING, DOWN = "up", "recovering", "down"


class _Transfer:
    """One write(): its planned slices as uint64 rows (local offset, remote offset,
    length), read by ``dp_items_fill`` at post time, never walked in Python."""

    __slots__ = ("abandoned", "done", "end", "expired", "fut", "lkey", "local_base",
                 "nbytes", "nslices", "peer", "ptr", "remaining", "remote", "rows",
                 "stopped", "timer")

    def __init__(self, fut: asyncio.Future, peer: _Peer, rows: np.ndarray, region: Region,
                 remote: str):
        self.fut, self.peer, self.rows, self.remote = fut, peer, rows, remote
        self.local_base, self.lkey = region.addr, region.lkey
        self.nbytes = int(rows[:, 2].sum())
        self.end = int((rows[:, 1] + rows[:, 2]).max())     # the remote region must hold it
        self.ptr = ffi.cast("uint64_t *", ffi.from_buffer(rows))
        self.remaining = self.nslices = len(rows)
        self.done = False           # data-path thread: resolved (or cancelled)
        self.abandoned = False      # loop: nobody awaits the future any more
        self.timer: asyncio.TimerHandle | None = None   # loop: the write's bound
        # Loop: set when the write is given up (its awaiter cancelled, its bound past):
        # resolved once the data-path thread stopped it (:meth:`TransferEngine._stop`).
        self.stopped: asyncio.Future | None = None
        self.expired: BaseException | None = None       # loop: the writer's error then


class _Seg:
    """Slices ``[start, stop)`` of a transfer: queued, or posted on one connection as the
    WRs ``first_wr ..`` in order. Retries, credits and completions count whole segments
    (split where a post or a completion ends inside one)."""

    __slots__ = ("attempts", "first_wr", "start", "stop", "transfer")

    def __init__(self, transfer: _Transfer, start: int, stop: int, attempts: int = 0):
        self.transfer, self.start, self.stop, self.attempts = transfer, start, stop, attempts
        self.first_wr = 0

    def cut(self, k: int) -> _Seg:
        """Take the first ``k`` slices off as a segment of their own."""
        head = _Seg(self.transfer, self.start, self.start + k, self.attempts)
        head.first_wr = self.first_wr
        self.start += k
        if self.first_wr:
            self.first_wr += k
        return head


# The event loop -> the data-path thread: typed commands on a deque (no lock; a wake-up
# only where the thread sleeps: _IDLE on its Event, _POLLING in the provider's wait).
_IDLE, _POLLING = "idle", "polling"


class _Submit(NamedTuple):
    transfer: _Transfer


class _Cancel(NamedTuple):
    transfer: _Transfer


class _AddPeer(NamedTuple):
    peer: _Peer


class _ConnUp(NamedTuple):
    conn: _Conn


class _ConnDown(NamedTuple):
    conn: _Conn
    cause: BaseException | None


class _Discard(NamedTuple):
    conns: list[Connection]


class _Stop(NamedTuple):
    pass


_Command = _Submit | _Cancel | _AddPeer | _ConnUp | _ConnDown | _Discard | _Stop


# The data-path thread -> the event loop: typed events, delivered in batches by
# call_soon_threadsafe (_flush_events).
class _Resolved(NamedTuple):
    """A transfer ended: every byte landed (``error`` None) or it failed."""

    transfer: _Transfer
    error: BaseException | None


class _Recover(NamedTuple):
    """A connection was reset: reconnect it."""

    conn: _Conn


class _Stopped(NamedTuple):
    """A transfer given up is stopped: nothing of it is queued or on the wire."""

    transfer: _Transfer


_Event = _Resolved | _Recover | _Stopped


class _Conn:
    __slots__ = ("conn", "fifo", "index", "peer", "posted", "state", "wrs")

    def __init__(self, peer: _Peer, index: int, conn: Connection):
        self.peer, self.index, self.conn = peer, index, conn
        self.state = UP
        self.posted = 0                     # WRITEs posted on it, ever
        self.fifo: deque[_Seg] = deque()    # posted, not yet retired, in post order
        self.wrs = 0                        # WRs in fifo


class _Peer:
    def __init__(self, name: str, regions: dict[str, RegionInfo]):
        self.name = name
        self.regions = regions              # replaced whole by the loop on recovery
        self.conns: list[_Conn] = []
        self.pending: deque[_Seg] = deque()     # data-path thread
        self.rr = 0                             # data-path thread: spreading rotation


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
        self._peers: dict[str, _Peer] = {}
        self._connecting: dict[str, asyncio.Task] = {}
        self._recoveries: set[asyncio.Task] = set()
        self._connector = ThreadPoolExecutor(2, thread_name_prefix=f"dp-connect-{name}")
        self._cmds: deque[tuple] = deque()
        self._kick = threading.Event()
        self._sleeping: str | None = None       # where the data-path thread sleeps, if it does
        self._thread: threading.Thread | None = None
        self._dead: BaseException | None = None
        self._stopping: set[_Transfer] = set()     # given up, not yet stopped (loop)
        # Data-path thread only.
        self._w_peers: dict[str, _Peer] = {}
        self._w_conns: dict[int, _Conn] = {}
        self._inflight = 0
        self._wr_seq = 0
        self._events: list[_Event] = []

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
        self.oob.serve(self.name, self._handle_connect)
        self._thread = threading.Thread(target=self._run, name=f"dp-transfer-{self.name}",
                                        daemon=True)
        self._thread.start()
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
                 length: int | None = None, gpu_device: int | None = None) -> Region:
        """Register a buffer (or a raw range the caller keeps alive; device memory of GPU
        ``gpu_device`` when given) once, as ``name``: the source of our writes and a
        target of peers' writes. Loop thread."""
        if self._state not in ("new", "running"):
            raise UsageError(f"transfer engine {self.name} is closed")
        if name in self._regions:
            raise UsageError(f"a region named {name!r} is already registered")
        if gpu_device is not None:
            region = self.provider.register_gpu(addr, length, gpu_device)
            self._gpu[name] = gpu_device
        else:
            region = self.provider.register(buf, addr=addr, length=length)
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
                  else self.provider.register(addr=addr, length=length))
        self._regions[name] = region
        self.stats["rekeys"] += 1
        log.info("transfer engine %s: region %r rekeyed (fence)", self.name, name)
        return region

    def region_infos(self) -> dict[str, RegionInfo]:
        return {n: RegionInfo(r.addr, r.length, r.rkey) for n, r in self._regions.items()}

    async def connect(self, peer: str) -> None:
        """Connect to ``peer`` now (write() does it on first use)."""
        await self._peer(peer)

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
        t = _Transfer(self._loop.create_future(), p, rows, region, remote)
        # The bound is one timer on the loop (wait_for and shield cost two futures and
        # four callbacks a write); delivery cancels it.
        t.timer = self._loop.call_later(bound, self._expire, t, peer, bound)
        self._command(_Submit(t))
        try:
            await t.fut
        except asyncio.CancelledError:
            if t.fut.cancelled():       # our caller was cancelled (not the engine closing)
                t.timer.cancel()
                t.abandoned = True
                await self._stop(t)
            raise

    def _expire(self, t: _Transfer, peer: str, bound: float) -> None:
        """Loop: ``t`` is past its bound: the data-path thread stops it and recovers the
        connections carrying it, then its writer gets TransferTimeout."""
        if t.fut.done():
            return
        t.abandoned = True
        t.expired = TransferTimeout(
            f"write of {t.nbytes} bytes ({t.nslices} slices) to peer {peer!r} did not "
            f"complete within {bound:.3g} s", errno=errno.ETIMEDOUT)
        self._give_up(t, t.fut)

    async def _stop(self, t: _Transfer) -> None:
        """Loop: stop a write whose awaiter was cancelled and return once the data-path
        thread has: the connections carrying it reset (a TCP connection closed abortively,
        a QP's work requests flushed), none of it queued. A cancelled writer may then say
        its writes ended (paths/fence.py) without waiting out the write's bound."""
        f = self._loop.create_future()
        self._give_up(t, f)
        await f

    def _give_up(self, t: _Transfer, f: asyncio.Future) -> None:
        t.stopped = f
        if self._dead is not None or self._state != "running":
            self._stopped(t)          # no data-path thread to ask; close() fails the rest
            return
        self._stopping.add(t)
        self._command(_Cancel(t))

    def _stopped(self, t: _Transfer) -> None:
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
            self._command(_Stop())
            await asyncio.to_thread(self._thread.join)
        # Nothing else runs now: connects in the executor finish within their bound.
        await asyncio.to_thread(self._connector.shutdown, True)
        closed = TransferError(f"transfer engine {self.name} closed")
        for cmd in self._cmds:
            if isinstance(cmd, _Submit):
                self._finish(cmd.transfer, closed)
        self._cmds.clear()
        self._fail_everything(closed)
        self._deliver(self._events)
        self._events = []
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
        if self._dead is not None:
            raise TransferError(f"transfer engine {self.name}: data-path thread failed: "
                                f"{self._dead!r}")
        if self._state != "running":
            raise UsageError(f"transfer engine {self.name} is {self._state}, not running")

    def _command(self, cmd: _Command) -> None:
        self._cmds.append(cmd)
        # A running data-path thread reads the deque before it sleeps again (_step says
        # where it sleeps, then looks): a wake-up then is a syscall and a context switch
        # for nothing. (The GIL orders these reads and writes.)
        where = self._sleeping
        if where is _IDLE:
            self._kick.set()
        elif where is _POLLING:
            self.provider.wake()

    async def _run_blocking(self, fn, *args):
        return await self._loop.run_in_executor(self._connector, fn, *args)

    async def _peer(self, name: str) -> _Peer:
        p = self._peers.get(name)
        if p is not None:
            return p
        task = self._connecting.get(name)
        if task is None:
            task = self._loop.create_task(self._connect_peer(name))
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

    async def _connect_peer(self, name: str) -> _Peer:
        n = self.config.connections_per_peer
        conns: list[Connection] = []
        try:
            for _ in range(n):
                conns.append(self.provider.connection(self.config.max_send_wr))
            if self._to_self(name):
                for c in conns:
                    c.connect_self()
                regions = self.region_infos()
            else:
                req = ConnectRequest(self.name, self.transport, tuple(range(n)),
                                     tuple(c.endpoint() for c in conns))
                reply = await self.oob.request(name, req)
                self._check_reply(name, reply, n)
                await asyncio.gather(*(self._run_blocking(c.connect, ep,
                                                          self.config.connect_timeout_s)
                                       for c, ep in zip(conns, reply.endpoints)))
                regions = reply.regions
        except BaseException as e:
            # Connected sockets may already have events queued on the data-path thread's
            # completion stream: only that thread may close them.
            self._command(_Discard(conns))
            if isinstance(e, (DualPathError, OSError)):
                raise TransferError(f"cannot connect to peer {name!r}: {e}",
                                    errno=getattr(e, "errno", 0) or 0) from e
            raise
        p = _Peer(name, dict(regions))
        p.conns = [_Conn(p, i, c) for i, c in enumerate(conns)]
        self._peers[name] = p
        self._command(_AddPeer(p))
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
        return ConnectReply(self.transport, eps, self.region_infos())

    def _start_recovery(self, c: _Conn) -> None:
        if self._state != "running":
            return
        task = self._loop.create_task(self._recover(c))
        self._recoveries.add(task)
        task.add_done_callback(self._recoveries.discard)

    async def _recover(self, c: _Conn) -> None:
        p, attempts, delay = c.peer, self.config.recover_attempts, 0.05
        last: BaseException | None = None
        for attempt in range(1, attempts + 1):
            try:
                if attempt > 1:
                    c.conn.reset()      # a half-made connect; nothing is posted on it
                if self._to_self(p.name):
                    p.regions = self.region_infos()     # keys as they are now (a rekey)
                    c.conn.connect_self()
                else:
                    req = ConnectRequest(self.name, self.transport, (c.index,),
                                         (c.conn.endpoint(),))
                    reply = await self.oob.request(p.name, req)
                    self._check_reply(p.name, reply, 1)
                    p.regions = dict(reply.regions)
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
            self._command(_ConnUp(c))
            return
        self._command(_ConnDown(c, last))

    def _deliver(self, events: list[_Event]) -> None:
        """Loop: act on a batch of data-path events."""
        for ev in events:
            match ev:
                case _Resolved(t, exc):
                    if t.timer is not None:
                        t.timer.cancel()
                    if t.abandoned or t.fut.done():
                        continue
                    if exc is None:
                        t.fut.set_result(None)
                    else:
                        t.fut.set_exception(exc)
                case _Recover(c):
                    self._start_recovery(c)
                case _Stopped(t):
                    self._stopped(t)

    # ------------------------------------------------------------------ data-path thread

    def _run(self) -> None:
        try:
            while self._step():
                pass
        except BaseException as e:     # never leave writers waiting on a dead thread
            log.exception("transfer engine %s: data-path thread failed", self.name)
            self._dead = e
            self._fail_everything(TransferError(f"transfer engine {self.name}: data-path "
                                                f"thread failed: {e!r}"))
        self._flush_events()

    def _step(self) -> bool:
        if not self._apply_commands():
            return False
        self._post_pending()
        if self._inflight == 0:
            self._flush_events()
            self._sleeping = _IDLE
            if not self._cmds:
                self._kick.wait(0.5)
            self._sleeping = None
            self._kick.clear()
            return True
        self._sleeping = _POLLING
        comps = self.provider.wait(0.0 if self._cmds else self.provider.poll_slice_s)
        self._sleeping = None
        if comps:
            self._on_completions(comps)
        self._flush_events()
        return True

    def _flush_events(self) -> None:
        if self._events:
            events, self._events = self._events, []
            try:
                self._loop.call_soon_threadsafe(self._deliver, events)
            except RuntimeError:        # the loop is closed: nobody is waiting
                pass

    def _apply_commands(self) -> bool:
        while self._cmds:
            match self._cmds.popleft():
                case _Submit(t):
                    t.peer.pending.append(_Seg(t, 0, t.nslices))
                case _AddPeer(p):
                    self._w_peers[p.name] = p
                    for c in p.conns:
                        self._w_conns[c.conn.conn_id] = c
                case _ConnUp(c):
                    c.state = UP
                case _ConnDown(c, cause):
                    self._conn_down(c, cause)
                case _Cancel(t):
                    self._cancel(t)
                case _Discard(conns):
                    for conn in conns:
                        conn.close()
                case _Stop():
                    return False
        return True

    def _post_pending(self) -> None:
        for p in self._w_peers.values():
            if not p.pending:
                continue
            ups = [c for c in p.conns if c.state == UP]
            if not ups:
                if not any(c.state == RECOVERING for c in p.conns):
                    for c in p.conns:           # all DOWN: a new write asks again
                        self._recover_later(c)
                continue
            k = p.rr % len(ups)
            ups = ups[k:] + ups[:k]
            p.rr += 1
            for c, segs in zip(ups, self._place(p, ups)):
                if segs:
                    self._post(c, segs)

    def _place(self, p: _Peer, ups: list[_Conn]) -> list[list[_Seg]]:
        """Take the peer's queued segments, in order, onto its UP connections (``ups``,
        in this round's rotation) within their credits: a transfer of fewer than
        config.spread_min_bytes goes whole to the connection with the fewest WRs in
        flight (its one post and one completion: the data path's Python cost per layer
        does not grow with its blocks); a larger one is spread over all of them
        (plan.spread). A segment is cut only where credits end (its rest goes on to the
        next connection with room, or waits at the queue's head)."""
        caps = [c.conn.max_send_wr for c in ups]
        rooms = [cap - c.wrs for cap, c in zip(caps, ups)]     # a load is cap - room
        out: list[list[_Seg]] = [[] for _ in ups]
        spread_min = self.config.spread_min_bytes
        while p.pending:
            s = p.pending[0]
            if s.transfer.done:
                p.pending.popleft()
                continue
            m = s.stop - s.start
            if s.transfer.nbytes >= spread_min and len(ups) > 1:
                counts = spread(m, rooms)
            else:
                j = -1                          # the least loaded with room
                for i, r in enumerate(rooms):
                    if r > 0 and (j < 0 or caps[i] - r < caps[j] - rooms[j]):
                        j = i
                if j < 0:
                    break
                counts = [0] * len(ups)
                counts[j] = min(m, rooms[j])
            taken = 0
            for i, n in enumerate(counts):
                if n:
                    out[i].append(s.cut(n) if n < m - taken else p.pending.popleft())
                    taken += n
                    rooms[i] -= n
            if taken < m and not any(rooms):    # credits ran out: the rest waits
                break
        return out

    def _post(self, c: _Conn, segs: list[_Seg]) -> None:
        """Post ``segs`` (taken off the peer's queue) on ``c``: one dp_items_fill per
        segment, one post (doorbell) for them all; what the post did not take goes back
        to the queue's head."""
        p, items, regions = c.peer, c.conn.items, c.peer.regions
        batch: list[_Seg] = []
        filled = 0
        for part in segs:
            t = part.transfer
            if t.done:          # failed for good by a post on another connection this round
                continue
            info = regions.get(t.remote)
            if info is None or t.end > info.length:
                self._finish(t, TransferError(
                    f"write to {p.name!r}: the peer's region {t.remote!r} is gone or now "
                    f"shorter than {t.end} bytes", status=WcStatus.REM_ACCESS_ERR))
                continue
            k = part.stop - part.start
            part.first_wr = self._wr_seq + 1
            lib.dp_items_fill(items + filled, k, t.ptr + 3 * part.start,
                              t.local_base, t.lkey, info.addr, info.rkey, part.first_wr)
            self._wr_seq += k
            filled += k
            batch.append(part)
        if not batch:
            return
        failure = None
        try:
            posted = c.conn.post(filled, self.config.signal_every)
        except PostError as e:
            posted, failure = e.posted, e
        c.posted += posted
        c.wrs += posted
        self._inflight += posted
        self.stats["posts"] += 1
        self.stats["writes_posted"] += posted
        back: list[_Seg] = []
        for part in batch:
            k = part.stop - part.start
            if posted >= k:
                c.fifo.append(part)
                posted -= k
            else:
                if posted:
                    c.fifo.append(part.cut(posted))
                    posted = 0
                part.first_wr = 0
                back.append(part)
        for part in reversed(back):
            p.pending.appendleft(part)
        if failure is not None:
            self._break(c, f"post failed: {failure}")

    def _retire(self, c: _Conn, k: int) -> list[_Seg]:
        """The first ``k`` WRs of ``c``'s FIFO, as segments (the last one cut to fit)."""
        out = []
        got = 0
        while k and c.fifo:
            s = c.fifo[0]
            m = s.stop - s.start
            if m <= k:
                out.append(c.fifo.popleft())
            else:
                out.append(s.cut(k))
                m = k
            k -= m
            got += m
        c.wrs -= got
        self._inflight -= got
        return out

    def _on_completions(self, comps: list[Completion]) -> None:
        for wc in comps:
            c = self._w_conns.get(wc.qp_num)
            if c is None or c.state != UP:
                continue                # a late completion of a connection since reset
            retired = self._retire(c, wc.retired)
            last = retired[-1] if retired else None
            if last is None or last.first_wr + last.stop - last.start - 1 != wc.wr_id:
                for s in retired:
                    self._seg_failed(s, WcStatus.WR_FLUSH_ERR, retry=True)
                self._break(c, f"completion wr_id {wc.wr_id} out of order")
                continue
            if wc.status == WcStatus.SUCCESS:
                for s in retired:
                    self._seg_done(s)
                continue
            if wc.status in ITEM_ERRORS:
                if last.stop - last.start > 1:  # RC order: the WRs before it landed
                    retired.insert(-1, last.cut(last.stop - last.start - 1))
                for s in retired[:-1]:
                    self._seg_done(s)
                self._seg_failed(retired[-1], wc.status, retry=False)
            else:
                for s in retired:
                    self._seg_failed(s, wc.status, retry=True)
            self.stats["error_completions"] += 1
            self._break(c, f"{status_name(wc.status)}"
                        + (f", vendor_err {wc.vendor_err}" if wc.vendor_err else ""))
            if wc.status in ITEM_ERRORS:
                # The peer's keys may be stale (it re-registered, or shrank a region):
                # its other connections post with the same ones, so they reconnect too
                # and nothing more is posted before the exchange refreshed them.
                for o in c.peer.conns:
                    if o.state == UP:
                        self._break(o, f"a write to the same peer got {status_name(wc.status)}")

    def _break(self, c: _Conn, cause: str) -> None:
        """Take a failed connection out of service: reset it now (dropping what it had in
        flight back into the queue) and ask the loop to reconnect it."""
        c.state = RECOVERING
        try:
            c.conn.reset()
        except DualPathError as e:
            log.error("transfer engine %s: resetting a connection to %s failed: %s",
                      self.name, c.peer.name, e)
        rest = list(c.fifo)
        lost = c.wrs
        c.fifo.clear()
        self._inflight -= lost
        c.wrs = 0
        for s in reversed(rest):                # back to the queue's head, in order
            s.first_wr = 0
            self._seg_failed(s, WcStatus.WR_FLUSH_ERR, retry=True)
        self.stats["recoveries"] += 1
        log.warning("transfer engine %s: peer %s connection %d: %s; reset, reconnecting "
                    "(%d in-flight slices back in the queue)", self.name, c.peer.name,
                    c.index, cause, lost)
        self._events.append(_Recover(c))

    def _recover_later(self, c: _Conn) -> None:
        c.state = RECOVERING
        self._events.append(_Recover(c))

    def _conn_down(self, c: _Conn, exc: BaseException | None) -> None:
        c.state = DOWN
        p = c.peer
        if any(x.state != DOWN for x in p.conns):
            return
        err = TransferError(f"peer {p.name!r} is unreachable: {exc}",
                            errno=getattr(exc, "errno", 0) or 0)
        while p.pending:
            self._finish(p.pending.popleft().transfer, err)

    def _cancel(self, t: _Transfer) -> None:
        """A transfer timed out (or its awaiter was cancelled): stop it, and recover the
        connections still carrying its slices (reset: nothing of it lands after this), then
        tell the loop it stopped."""
        if not t.done:
            t.done = True
            why = "a write timed out on it" if t.expired is not None else \
                "a write given up by its caller was on it"
            for c in t.peer.conns:
                if c.state == UP and any(s.transfer is t for s in c.fifo):
                    self._break(c, why)
        self._events.append(_Stopped(t))

    def _seg_done(self, s: _Seg) -> None:
        t = s.transfer
        if t.done:
            return
        t.remaining -= s.stop - s.start
        if t.remaining == 0:
            self._finish(t, None)

    def _seg_failed(self, s: _Seg, status: int, *, retry: bool) -> None:
        t = s.transfer
        if t.done:
            return
        if retry and s.attempts < self.config.max_retries:
            s.attempts += 1
            self.stats["retried_slices"] += s.stop - s.start
            s.first_wr = 0
            t.peer.pending.appendleft(s)
            return
        tries = f" after {s.attempts + 1} attempts" if retry else ""
        _, remote_off, length = (int(x) for x in t.rows[s.start])
        self._finish(t, TransferError(
            f"write of {t.nbytes} bytes to peer {t.peer.name!r} failed{tries}: "
            f"{status_name(status)} on {length} bytes at {t.remote!r}+{remote_off}",
            status=status))

    def _finish(self, t: _Transfer, exc: BaseException | None) -> None:
        if t.done:
            return
        t.done = True
        self._events.append(_Resolved(t, exc))

    def _fail_everything(self, exc: BaseException) -> None:
        for p in self._w_peers.values():
            for c in p.conns:
                for s in c.fifo:
                    self._finish(s.transfer, exc)
            while p.pending:
                self._finish(p.pending.popleft().transfer, exc)
