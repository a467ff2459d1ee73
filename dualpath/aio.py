"""Waiting for work that writes into memory the waiter owns.

A read or copy handed to a thread (or the kernel) goes on writing into its buffer after
whoever awaited it is cancelled. A caller that frees or hands back that buffer as it
unwinds must first wait for the work to end, and a second cancel (a shutdown cancelling
the task again) must not cut that wait short. Pure asyncio; no state."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def waited_out(*futs: asyncio.Future) -> bool:
    """Wait until every one of ``futs`` is done, whatever cancels the caller meanwhile;
    whether something did (the caller re-raises when it must)."""
    cancelled = False
    while not all(f.done() for f in futs):
        try:
            await asyncio.wait(futs)
        except asyncio.CancelledError:
            cancelled = True
    return cancelled


async def to_the_end(aw: Awaitable[T]) -> T:
    """``await aw``, shielded: a cancelled caller waits for it to end (see
    :func:`waited_out`) before the cancellation goes on; its outcome then is retrieved
    (the cancellation is what the caller reports).

    Hand it a plain future where the work is a thread's (``run_in_executor``,
    ``wrap_future``): a coroutine becomes a task, and a loop shutting down cancels
    tasks (the task is then done while its thread still writes)."""
    fut = asyncio.ensure_future(aw)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        await waited_out(fut)
        if not fut.cancelled():
            fut.exception()
        raise


def retrieved(f: asyncio.Future) -> asyncio.Future:
    """``f``, its error marked seen once it ends: for a future whose awaiter may be gone
    first (a forward closing, a stage let go before its instance asked for it); else
    asyncio logs "exception was never retrieved" with a traceback."""
    f.add_done_callback(lambda x: x.cancelled() or x.exception())
    return f


async def all_landed(aws) -> list:
    """``gather(*aws)`` of reads on the store's pool, returning (or raising the first
    error) only once every one has ended: a pool thread keeps writing into its buffer,
    and reading its block's descriptor, after whoever awaited it was cancelled or saw
    another read fail. So a cancelled caller waits for them before it raises, and the
    slots they fill are not given back, nor their descriptors closed, under them."""
    out = await to_the_end(asyncio.gather(*aws, return_exceptions=True))
    for x in out:
        if isinstance(x, BaseException):
            raise x
    return out
