"""Moving one request's KV layer by layer: the step every read path shares.

The PE read path (PE buffer -> the PE's own engine memory), the DE read path (DE buffer
-> a remote PE's engine memory) and the vLLM connector's load (PE buffer -> a vLLM
worker's KV tensors) are the same loop: for each layer, the WRITE runs from the buffer's
placement to the target's (dualpath/kv/placement.py), then "layer l is in place" to
whoever waits for it. :func:`write_layers` is that loop, with two layers in flight so
the wire never idles between layers; :func:`write_layer` issues one layer's runs as one
array (placement.run_arrays: no Python step per block) in one TransferEngine write, and
:func:`write_layers` computes a request's runs once (placement.LayerMove), each later
layer's being the first one's shifted.

Threads: the node's (or worker agent's) event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Protocol

from dualpath.kv.placement import KvPlacement, LayerMove, run_arrays
from dualpath.transfer import TransferEngine


class LayerReady(Protocol):
    """Where a layer comes from (paths/layers.py's LayerSource is one): ``ready(l)``
    returns once layer ``l`` is in place."""

    async def ready(self, layer: int) -> None: ...


async def write_layer(transfer: TransferEngine, peer: str, src: KvPlacement,
                      src_units: Sequence[int], dst: KvPlacement, dst_units: Sequence[int],
                      layer: int, first_token: int, stop_token: int) -> int:
    """WRITE layer ``layer``'s tokens ``[first_token, stop_token)`` from ``src`` to
    ``peer``'s ``dst`` in one transfer; the bytes moved once all landed."""
    return await write_rows(transfer, peer, *run_arrays(src, src_units, dst, dst_units,
                                                        layer, first_token, stop_token))


async def write_rows(transfer: TransferEngine, peer: str, src_region: str,
                     dst_region: str, rows) -> int:
    """WRITE uint64 ``(src_offset, dst_offset, length)`` rows from ``src_region`` to
    ``peer``'s ``dst_region`` in one transfer; the bytes moved once all landed."""
    if len(rows):
        await transfer.write(peer, rows, local=src_region, remote=dst_region)
    return int(rows[:, 2].sum())


async def write_layers(transfer: TransferEngine, peer: str, src: KvPlacement,
                       src_units: Sequence[int], dst: KvPlacement, dst_units: Sequence[int],
                       first_token: int, stop_token: int,
                       on_layer: Callable[[int], None] | None = None,
                       layers: Sequence[int] | None = None,
                       source: LayerReady | None = None) -> int:
    """WRITE tokens ``[first_token, stop_token)`` of every layer (or of ``layers``) from
    ``src`` to ``peer``'s ``dst``, in layer order; a layer starts once ``source`` says
    it is in ``src`` (when given: layers still being read from storage);
    ``on_layer(n)`` after the n-th layer landed (n counts from 1). Returns the bytes
    moved. At most two layers are in flight; on an error, the other layer in flight is
    waited for before raising, and on a cancel it is stopped (TransferEngine.write), so
    nothing still reads ``src`` or writes ``dst`` once this returns. The peer's grant for
    ``dst`` is fetched first where its windows are keys (TransferEngine.rescope)."""
    order = list(range(src.fmt.layers) if layers is None else layers)
    if stop_token <= first_token:
        for n in range(1, len(order) + 1):
            if on_layer is not None:
                on_layer(n)
        return 0

    move = LayerMove(src, src_units, dst, dst_units, [(first_token, stop_token)])
    await transfer.rescope(peer)        # the windows of the grant we write under

    def start(layer: int) -> asyncio.Future:
        return asyncio.ensure_future(write_rows(transfer, peer, *move.rows(layer)))

    async def begin(i: int) -> asyncio.Future:
        if source is not None:
            await source.ready(order[i])
        return start(order[i])

    total = 0
    inflight: list[asyncio.Future] = []
    try:
        inflight.append(await begin(0))
        for n in range(1, len(order) + 1):
            if n < len(order):
                inflight.append(await begin(n))
            # Shielded: the handler below, not the await, decides what a cancel does to
            # the writes in flight.
            total += await asyncio.shield(inflight[0])
            inflight.pop(0)
            if on_layer is not None:
                on_layer(n)
    except asyncio.CancelledError:
        # Cancelled: give the writes in flight up. Each returns once the transfer engine
        # stopped it (its connections reset: none of its bytes lands after), so the
        # finally's wait is that, not the write's bound (a peer cut off would hold us
        # there for transfer.timeout_s).
        for f in inflight:
            f.cancel()
        raise
    finally:
        pending = [f for f in inflight if not f.done()]
        if pending:
            await asyncio.wait(pending)
        for f in inflight:
            if f.done() and not f.cancelled():
                f.exception()          # retrieved: no "never retrieved" warning
    return total
