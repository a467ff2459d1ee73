"""Memory a peer may still be writing into, held back until that peer says it stopped.

KV moves by one-sided WRITEs: the memory's owner never sees them land. When a request's
attempt ends on one side while the other side may still be writing into memory it was
given (a DE's buffer slots, which the PE pushes into; a PE engine's HBM, which the DE
writes on the DE read path), handing that memory to another request could let the old
attempt's bytes land in it. So the memory is *fenced*: held by :class:`Fences` and not
returned to its pool until the writer answers Engine.CancelRequest for that attempt,
which it does only after its own tasks for it ended (each waits for its writes in
flight: kvio.write_layers, PrefillPath.prefill). A writer that restarted answers at once
(it runs nothing); one that is stalled or cut off answers when it is back, and the
memory waits for it (asked again with capped backoff). The writer telling us first
(its own CancelRequest, for a request we dropped) releases the fence as well.

A writer whose writes all resolved has nothing on the wire any more: a timed-out or
cancelled write resets its connection, and the TCP provider resets with RST, so queued
bytes are discarded, not delivered (verbs: the QP's reset flushes its work requests).

A fence that is never answered keeps its memory (correct bytes over memory): after
:data:`ASK_FOR_S` the asking stops, one error line says which peer and request, and
``dualpath_node_fenced_blocks`` keeps showing the blocks.

Threads: the node's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from dualpath.buffers.pool import Reservation
from dualpath.errors import DualPathError
from dualpath.tls import Identity

log = logging.getLogger("dualpath.node")

#: How long a fence asks its writer before it gives up asking (the memory stays held).
ASK_FOR_S = 600.0
ASK_BACKOFF_S = (0.1, 2.0)

#: ``ask(peer, request_id, attempt, writer)``: returns once the peer's writes for that
#: attempt ended; raises DualPathError when the peer did not answer (or, ``writer``
#: given, a server other than that identity answered at ``peer``).
Ask = Callable[[str, str, int, Identity | None], Awaitable[None]]


@dataclass
class _Fence:
    peer: str
    request_id: str
    attempt: int
    memory: Reservation
    writer: Identity | None             # who may release it by telling us (plaintext: None)
    asking: asyncio.Task | None = None
    since: float = field(default_factory=time.monotonic)


class Fences:
    """The fenced memory of one node. ``spawn`` runs a task the node cancels at close;
    ``gauge`` (optional) shows the fenced blocks."""

    def __init__(self, ask: Ask, spawn: Callable, gauge=None):
        self.ask = ask
        self.spawn = spawn
        self.gauge = gauge
        self.held: list[_Fence] = []

    @property
    def blocks(self) -> int:
        return sum(len(f.memory.slots) for f in self.held)

    def hold(self, peer: str, request_id: str, attempt: int, memory: Reservation, *,
             writer: Identity | None = None) -> None:
        """Fence ``memory`` (a request's reservation) until ``peer`` says its writes for
        ``attempt`` of ``request_id`` ended; ``writer`` is the identity whose own
        CancelRequest for it may say so too."""
        if memory.released:
            return
        f = _Fence(peer, request_id, attempt, memory, writer)
        self.held.append(f)
        f.asking = self.spawn(self._ask(f))
        self._show()
        log.info("fenced %d blocks of %s (attempt %d) until %s says its writes ended",
                 len(memory.slots), request_id, attempt, peer)

    def settled(self, request_id: str, attempt: int, caller: Identity | None) -> int:
        """The writer ``caller`` says its attempts of ``request_id`` up to ``attempt``
        (0 = all) ended: release what was fenced for them. Returns the blocks released."""
        n = 0
        for f in list(self.held):
            if f.request_id == request_id and (not attempt or f.attempt <= attempt) and \
                    (caller is None or caller == f.writer):
                n += self._release(f)
                if f.asking is not None:
                    f.asking.cancel()
                log.info("fence of %s (attempt %d) released: %s says its writes ended (%d "
                         "blocks, %.2f s)", request_id, f.attempt, f.peer, len(f.memory.slots),
                         time.monotonic() - f.since)
        return n

    def _release(self, f: _Fence) -> int:
        if f not in self.held:
            return 0
        self.held.remove(f)
        n = len(f.memory.slots)
        f.memory.release()
        self._show()
        return n

    def _show(self) -> None:
        if self.gauge is not None:
            self.gauge.set(self.blocks)

    async def _ask(self, f: _Fence) -> None:
        delay, last = ASK_BACKOFF_S[0], ""
        while time.monotonic() - f.since < ASK_FOR_S:
            try:
                await self.ask(f.peer, f.request_id, f.attempt, f.writer)
            except DualPathError as e:
                if str(e) != last:
                    log.warning("fence of %s (attempt %d): %s has not answered yet: %s",
                                f.request_id, f.attempt, f.peer, e)
                    last = str(e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, ASK_BACKOFF_S[1])
                continue
            n = self._release(f)
            log.info("fence of %s (attempt %d) released: %s stopped writing (%d blocks, "
                     "%.2f s)", f.request_id, f.attempt, f.peer, n,
                     time.monotonic() - f.since)
            return
        log.error("fence of %s (attempt %d): %s never answered in %g s; its %d blocks stay "
                  "held (dualpath_node_fenced_blocks)", f.request_id, f.attempt, f.peer,
                  ASK_FOR_S, len(f.memory.slots))
