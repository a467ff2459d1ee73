"""The hit KV of one assigned vLLM prefill, staged in the node's buffer before vLLM asks.

A prefill node that fetched an assignment starts its hit's reads at once, into a PE
buffer reservation (one slot per hit block, in prompt order), from the side(s) the
scheduler chose: its own storage reads for blocks ``[0, local)``, the DE's for
``[local, hit)`` (the DE reads them into its buffer and WRITEs each layer here). When
the prefill instance's connector looks the request up and loads it (presenting the
request's ticket), :class:`~dualpath.engines.vllm.engine.VllmEngine` serves that
reservation instead of reading the store: the load waits for layer l to be staged, not
read. Blocks the prefill computes (its saves) are handed to the stage's ``on_saved``,
which sends them to the DE.

The reservation is reference counted (:meth:`Stage.view` per load, the owner's own
reference): it goes back, through ``release`` (a plain release, or a fence while a DE may
still write into it), when the last holder let go. Threads: the node's event loop.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable, Callable, Sequence

from dualpath.aio import retrieved
from dualpath.buffers.pool import Reservation
from dualpath.paths.layers import LayerSource


class AllAtOnce(LayerSource):
    """Layer l is ready once every one of ``layers`` layers is (no layerwise loading:
    the basic mode's ablation, paper §5)."""

    def __init__(self, source: LayerSource, layers: int):
        self.source, self.layers = source, layers

    async def ready(self, layer: int) -> None:
        await self.source.ready(self.layers - 1)

    def close(self) -> None:
        self.source.close()


class SlotView:
    """Slots ``[first, first + n)`` of a stage's reservation, as a load sees them:
    ``slots``, ``flat(i)``, ``release()`` (its reference; idempotent)."""

    def __init__(self, stage: Stage, first: int, n: int):
        self.stage = stage
        self.first = first
        self.slots = stage.res.slots[first:first + n]
        self.released = False

    def __len__(self) -> int:
        return len(self.slots)

    def flat(self, i: int):
        return self.stage.res.flat(self.first + i)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.stage.unref()


class Stage:
    """See the module docstring. ``usable`` resolves to the leading hit blocks whose
    every layer is staged intact (known once all reads ended and verified); ``first``
    to those known usable before any layer arrived (a missing block ends the hit)."""

    def __init__(self, request_id: str, ticket: str, keys: list[bytes],
                 res: Reservation, source: LayerSource, first: Awaitable[int],
                 usable: Awaitable[int], release: Callable[[Reservation], None],
                 on_saved: Callable[[list[bytes], Reservation], None],
                 computed: Sequence[bytes] = (), salt: str = "", unsent: int = 0):
        self.request_id = request_id
        self.salt = salt                # the request's cache salt (its prefix cache's)
        # Leading prompt blocks its DE is not sent (its instance holds them): the
        # instance need not save them.
        self.unsent = unsent
        self.ticket = ticket
        self.keys = keys
        self.index = {k: i for i, k in enumerate(keys)}
        # The prompt's full blocks after the hit, which the instance computes: their
        # slots follow the hit's in ``res``, so its saves need no reservation of their
        # own (one reservation per request, taken whole: a request never holds part of
        # its slots while it waits for the rest).
        self.computed = {k: len(keys) + i for i, k in enumerate(computed)}
        self.res = res
        self.source = source
        # Retrieved: a stage let go before its instance asked (the instance died, the DE
        # dropped the request) leaves their errors unawaited.
        self.first = retrieved(asyncio.ensure_future(first))
        self.usable = retrieved(asyncio.ensure_future(usable))
        self._release = release
        self.on_saved = on_saved
        self.refs = 1                   # the owner's (the prefill path)

    def admits(self, request_id: str, ticket: str) -> bool:
        return request_id == self.request_id and hmac.compare_digest(ticket.encode(),
                                                                     self.ticket.encode())

    def match(self, keys: Sequence[bytes]) -> tuple[int, int]:
        """Where ``keys`` (a load's or a lookup's blocks, in order) sit in the stage:
        (first index, how many leading ones match); (0, 0) when the first is not here."""
        if not keys or keys[0] not in self.index:
            return 0, 0
        first = self.index[keys[0]]
        n = 0
        for k, mine in zip(keys, self.keys[first:]):
            if k != mine:
                break
            n += 1
        return first, n

    def save_slots(self, keys: Sequence[bytes]) -> int | None:
        """Where a save of ``keys`` (consecutive computed prompt blocks) sits in the
        stage's reservation: the index of its first, or None if they are not the
        computed blocks in order (a save the stage has no slots for)."""
        first = self.computed.get(keys[0], -1) if keys else -1
        if first < 0 or first + len(keys) > len(self.res.slots):
            return None
        if any(self.computed.get(k) != first + i for i, k in enumerate(keys)):
            return None
        return first

    def view(self, first: int, n: int) -> SlotView:
        self.refs += 1
        return SlotView(self, first, n)

    def unref(self) -> None:
        self.refs -= 1
        if self.refs == 0:
            for f in (self.first, self.usable):
                if not f.done():
                    f.cancel()
            self._release(self.res)
