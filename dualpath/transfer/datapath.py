"""The TransferEngine's data path: one thread that owns posting, polling and the state
they touch (the peers' queues, connection FIFOs and credits, resets), and the records it
shares with the event-loop side (transfers, segments, connections, peers; the typed
commands it takes and the typed events it emits).

Threads: :class:`DataPath`'s methods under "the thread" run on its thread only; the loop
calls :meth:`DataPath.start`, :meth:`DataPath.command`, :meth:`DataPath.stop` and, once
the thread is gone, :meth:`DataPath.drain`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter, deque
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from dualpath._native import ffi, lib
from dualpath.dp import PostError, WcStatus, WorkCompletion
from dualpath.errors import DualPathError, TransferError, UsageError
from dualpath.transfer.config import TransferConfig
from dualpath.transfer.provider import (
    ITEM_ERRORS,
    Connection,
    Provider,
    Region,
    RegionInfo,
    status_name,
)
from dualpath.transfer.slices import spread

log = logging.getLogger("dualpath.transfer")

UP, RECOVERING, DOWN = "up", "recovering", "down"


class Transfer:
    """One write(): its planned slices as uint64 rows (local offset, remote offset,
    length), read by ``dp_items_fill`` at post time, never walked in Python."""

    __slots__ = ("abandoned", "done", "end", "expired", "fut", "kptr", "lkey",
                 "local_base", "nbytes", "nslices", "peer", "ptr", "remaining", "remote",
                 "rkeys", "rows", "stopped", "timer")

    def __init__(self, fut: asyncio.Future, peer: Peer, rows: np.ndarray, region: Region,
                 remote: str, rkeys: np.ndarray | None = None):
        self.fut, self.peer, self.rows, self.remote = fut, peer, rows, remote
        self.local_base, self.lkey = region.addr, region.lkey
        self.nbytes = int(rows[:, 2].sum())
        self.end = int((rows[:, 1] + rows[:, 2]).max())     # the remote region must hold it
        self.ptr = ffi.cast("uint64_t *", ffi.from_buffer(rows))
        # A row's own rkey (a window of a region the peer scopes by key), else None.
        self.rkeys = rkeys
        self.kptr = None if rkeys is None else ffi.cast("uint32_t *", ffi.from_buffer(rkeys))
        self.remaining = self.nslices = len(rows)
        self.done = False           # data-path thread: resolved (or cancelled)
        self.abandoned = False      # loop: nobody awaits the future any more
        self.timer: asyncio.TimerHandle | None = None   # loop: the write's bound
        # Loop: set when the write is given up (its awaiter cancelled, its bound past):
        # resolved once the data-path thread stopped it (:meth:`TransferEngine._stop`).
        self.stopped: asyncio.Future | None = None
        self.expired: BaseException | None = None       # loop: the writer's error then


class Seg:
    """Slices ``[start, stop)`` of a transfer: queued, or posted on one connection as the
    WRs ``first_wr ..`` in order. Retries, credits and completions count whole segments
    (split where a post or a completion ends inside one)."""

    __slots__ = ("attempts", "first_wr", "start", "stop", "transfer")

    def __init__(self, transfer: Transfer, start: int, stop: int, attempts: int = 0):
        self.transfer, self.start, self.stop, self.attempts = transfer, start, stop, attempts
        self.first_wr = 0

    def cut(self, k: int) -> Seg:
        """Take the first ``k`` slices off as a segment of their own."""
        head = Seg(self.transfer, self.start, self.start + k, self.attempts)
        head.first_wr = self.first_wr
        self.start += k
        if self.first_wr:
            self.first_wr += k
        return head


# The event loop -> the data-path thread: typed commands on a deque (no lock; a wake-up
# only where the thread sleeps: IDLE on its Event, POLLING in the provider's wait).
IDLE, POLLING = "idle", "polling"


class Submit(NamedTuple):
    transfer: Transfer


class Cancel(NamedTuple):
    transfer: Transfer


class AddPeer(NamedTuple):
    peer: Peer


class ConnUp(NamedTuple):
    conn: Conn


class ConnDown(NamedTuple):
    conn: Conn
    cause: BaseException | None


class Discard(NamedTuple):
    conns: list[Connection]


class Stop(NamedTuple):
    pass


class Run(NamedTuple):
    """Run ``fn`` on the thread: a connection made, reset or closed where its CQ is
    polled and posted on (dp.h: never while another thread does), so posting and polling
    take no lock. ``fut`` (the loop's) gets its result."""

    fn: Callable[[], object]
    fut: asyncio.Future


Command = Submit | Cancel | AddPeer | ConnUp | ConnDown | Discard | Stop | Run


# The data-path thread -> the event loop: typed events, delivered in batches by
# call_soon_threadsafe (_flush_events).
class Resolved(NamedTuple):
    """A transfer ended: every byte landed (``error`` None) or it failed."""

    transfer: Transfer
    error: BaseException | None


class Recover(NamedTuple):
    """A connection was reset: reconnect it."""

    conn: Conn


class Stopped(NamedTuple):
    """A transfer given up is stopped: nothing of it is queued or on the wire."""

    transfer: Transfer


class Ran(NamedTuple):
    """A :class:`Run` ended: its result, or the error it raised."""

    fut: asyncio.Future
    result: object
    error: BaseException | None


Event = Resolved | Recover | Stopped | Ran


class Conn:
    __slots__ = ("conn", "fifo", "index", "peer", "posted", "state", "wrs")

    def __init__(self, peer: Peer, index: int, conn: Connection):
        self.peer, self.index, self.conn = peer, index, conn
        self.state = UP
        self.posted = 0                     # WRITEs posted on it, ever
        self.fifo: deque[Seg] = deque()    # posted, not yet retired, in post order
        self.wrs = 0                        # WRs in fifo


class Peer:
    def __init__(self, name: str, regions: dict[str, RegionInfo], identity: str = ""):
        self.name = name
        self.identity = identity            # who the exchange checked answers ("" none)
        self.regions = regions              # replaced whole by the loop on recovery
        # Loop: exchanges asked and the newest one applied (replies may cross: an older
        # answer never replaces a newer one; Peer.refresh).
        self.asked = self.applied = 0
        self.conns: list[Conn] = []
        self.pending: deque[Seg] = deque()     # data-path thread
        self.rr = 0                             # data-path thread: spreading rotation


    def ask(self) -> int:
        """Loop: the number of an exchange about to be sent."""
        self.asked += 1
        return self.asked

    def refresh(self, seq: int, regions: dict[str, RegionInfo]) -> None:
        """Loop: exchange ``seq``'s answer, unless a later exchange's is applied."""
        if seq > self.applied:
            self.regions, self.applied = dict(regions), seq


class DataPath:
    """The data-path thread and everything it owns: the peers' queues of segments, the
    connections' FIFOs and credits, posting, retiring, completions, resets. The event
    loop talks to it only through :meth:`command` (typed commands on a deque, a wake-up
    only where the thread sleeps); it answers with typed events, in batches, through
    ``deliver`` on the loop (``call_soon_threadsafe``)."""

    def __init__(self, name: str, provider: Provider, config: TransferConfig,
                 stats: Counter):
        self.name, self.provider, self.config, self.stats = name, provider, config, stats
        self._cmds: deque[Command] = deque()
        self._kick = threading.Event()
        self._sleeping: str | None = None       # where the thread sleeps, if it does
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._deliver: Callable[[list[Event]], None] | None = None
        #: Why the thread died (its writers were failed), or None.
        self.dead: BaseException | None = None
        # The thread's own.
        self._w_peers: dict[str, Peer] = {}
        self._w_conns: dict[int, Conn] = {}
        self._inflight = 0
        self._wr_seq = 0
        self._events: list[Event] = []

    # ------------------------------------------------------------------ loop side

    def start(self, loop: asyncio.AbstractEventLoop,
              deliver: Callable[[list[Event]], None]) -> None:
        self._loop, self._deliver = loop, deliver
        self._thread = threading.Thread(target=self._run, name=f"dp-transfer-{self.name}",
                                        daemon=True)
        self._thread.start()

    def command(self, cmd: Command) -> None:
        self._cmds.append(cmd)
        # A running data-path thread reads the deque before it sleeps again (_step says
        # where it sleeps, then looks): a wake-up then is a syscall and a context switch
        # for nothing. (The GIL orders these reads and writes.)
        where = self._sleeping
        if where is IDLE:
            self._kick.set()
        elif where is POLLING:
            self.provider.wake()

    async def call(self, fn: Callable[[], object]):
        """``fn()`` on the data-path thread; its result (or error) here. Commands run in
        order: one that follows it sees what it did."""
        if self.dead is not None:
            raise TransferError(f"transfer engine {self.name}: data-path thread failed: "
                                f"{self.dead!r}")
        if self._loop is None:
            raise UsageError(f"transfer engine {self.name} is not started")
        fut = self._loop.create_future()
        self.command(Run(fn, fut))
        return await fut

    async def stop(self) -> None:
        """Stop the thread (what it had queued stays, for :meth:`drain`)."""
        if self._thread is not None:
            self.command(Stop())
            await asyncio.to_thread(self._thread.join)

    def drain(self, exc: BaseException) -> list[Event]:
        """Once the thread is gone: every transfer still queued or in flight fails with
        ``exc``; the events of that, for the loop."""
        self._fail_queued(exc)
        self._fail_everything(exc)
        events, self._events = self._events, []
        return events

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        try:
            while self._step():
                pass
        except BaseException as e:     # never leave writers waiting on a dead thread
            log.exception("transfer engine %s: data-path thread failed", self.name)
            self.dead = e
            err = TransferError(f"transfer engine {self.name}: data-path thread failed: "
                                f"{e!r}")
            self._fail_queued(err)
            self._fail_everything(err)
        self._flush_events()

    def _fail_queued(self, exc: BaseException) -> None:
        """The thread will run no more commands: theirs fail with ``exc``."""
        while self._cmds:
            match self._cmds.popleft():
                case Submit(t):
                    self._finish(t, exc)
                case Run(_, fut):
                    self._events.append(Ran(fut, None, exc))
                case _:
                    pass

    def _step(self) -> bool:
        if not self._apply_commands():
            return False
        self._post_pending()
        if self._inflight == 0:
            self._flush_events()
            self._sleeping = IDLE
            if not self._cmds:
                self._kick.wait(0.5)
            self._sleeping = None
            self._kick.clear()
            return True
        self._sleeping = POLLING
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
                case Submit(t):
                    t.peer.pending.append(Seg(t, 0, t.nslices))
                case AddPeer(p):
                    self._w_peers[p.name] = p
                    for c in p.conns:
                        self._w_conns[c.conn.conn_id] = c
                case ConnUp(c):
                    c.state = UP
                case ConnDown(c, cause):
                    self._conn_down(c, cause)
                case Cancel(t):
                    self._cancel(t)
                case Discard(conns):
                    for conn in conns:
                        conn.close()
                case Run(fn, fut):
                    try:
                        self._events.append(Ran(fut, fn(), None))
                    except Exception as e:  # noqa: BLE001 - handed to the caller
                        self._events.append(Ran(fut, None, e))
                case Stop():
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

    def _place(self, p: Peer, ups: list[Conn]) -> list[list[Seg]]:
        """Take the peer's queued segments, in order, onto its UP connections (``ups``,
        in this round's rotation) within their credits: a transfer of fewer than
        config.spread_min_bytes goes whole to the connection with the fewest WRs in
        flight (its one post and one completion: the data path's Python cost per layer
        does not grow with its blocks); a larger one is spread over all of them
        (plan.spread). A segment is cut only where credits end (its rest goes on to the
        next connection with room, or waits at the queue's head)."""
        caps = [c.conn.max_send_wr for c in ups]
        rooms = [cap - c.wrs for cap, c in zip(caps, ups)]     # a load is cap - room
        out: list[list[Seg]] = [[] for _ in ups]
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

    def _post(self, c: Conn, segs: list[Seg]) -> None:
        """Post ``segs`` (taken off the peer's queue) on ``c``: one dp_items_fill per
        segment, one post (doorbell) for them all; what the post did not take goes back
        to the queue's head."""
        p, items, regions = c.peer, c.conn.items, c.peer.regions
        batch: list[Seg] = []
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
            if t.kptr is None:
                lib.dp_items_fill(items + filled, k, t.ptr + 3 * part.start,
                                  t.local_base, t.lkey, info.addr, info.rkey, part.first_wr)
            else:
                lib.dp_items_fill_keyed(items + filled, k, t.ptr + 3 * part.start,
                                        t.local_base, t.lkey, info.addr,
                                        t.kptr + part.start, part.first_wr)
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
        back: list[Seg] = []
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

    def _retire(self, c: Conn, k: int) -> list[Seg]:
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

    def _on_completions(self, comps: list[WorkCompletion]) -> None:
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

    def _break(self, c: Conn, cause: str) -> None:
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
        self._events.append(Recover(c))

    def _recover_later(self, c: Conn) -> None:
        c.state = RECOVERING
        self._events.append(Recover(c))

    def _conn_down(self, c: Conn, exc: BaseException | None) -> None:
        c.state = DOWN
        p = c.peer
        if any(x.state != DOWN for x in p.conns):
            return
        err = TransferError(f"peer {p.name!r} is unreachable: {exc}",
                            errno=getattr(exc, "errno", 0) or 0)
        while p.pending:
            self._finish(p.pending.popleft().transfer, err)

    def _cancel(self, t: Transfer) -> None:
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
        self._events.append(Stopped(t))

    def _seg_done(self, s: Seg) -> None:
        t = s.transfer
        if t.done:
            return
        t.remaining -= s.stop - s.start
        if t.remaining == 0:
            self._finish(t, None)

    def _seg_failed(self, s: Seg, status: int, *, retry: bool) -> None:
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

    def _finish(self, t: Transfer, exc: BaseException | None) -> None:
        if t.done:
            return
        t.done = True
        self._events.append(Resolved(t, exc))

    def _fail_everything(self, exc: BaseException) -> None:
        for p in self._w_peers.values():
            for c in p.conns:
                for s in c.fifo:
                    self._finish(s.transfer, exc)
            while p.pending:
                self._finish(p.pending.popleft().transfer, exc)
