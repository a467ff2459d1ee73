"""Layer sources: ``await ready(layer)`` before a layer computes (vLLM's
``wait_for_layer_load``, on the node side).

Two ways a prefill's hit KV arrives layer by layer:

- :class:`LocalArrivals`: this node writes it (the PE read path): the writer calls
  :meth:`LocalArrivals.landed` as each layer lands (``kvio.write_layers``' ``on_layer``).
- :class:`RemoteWatch`: a DE writes it (the DE read path) and streams its progress
  (Engine.WatchTransfers); the watch follows that stream.

Either way ``ready(l)`` returns once layer ``l`` is in place, and raises RequestFailed
once it cannot be (the writer failed, the stream broke). Threads: the node's event loop.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Sequence

import grpc

from dualpath.paths.errors import PeerUnavailable, RequestFailed


class LayerSource(ABC):
    """Hit KV arriving layer by layer for one request."""

    @abstractmethod
    async def ready(self, layer: int) -> None:
        """Return once layer ``layer`` (0-based) is in place; RequestFailed if it never
        will be."""

    def close(self) -> None:
        """Stop following (idempotent)."""


class AllReady(LayerSource):
    """Nothing to wait for (no hit, or every layer is already in place)."""

    async def ready(self, layer: int) -> None:
        return


class BothReady(LayerSource):
    """Layer l is ready when it is ready in every one of ``sources``."""

    def __init__(self, sources: Sequence[LayerSource]):
        self.sources = list(sources)

    async def ready(self, layer: int) -> None:
        for s in self.sources:
            await s.ready(layer)

    def close(self) -> None:
        for s in self.sources:
            s.close()


class _Counted(LayerSource):
    failure = RequestFailed          # what ready() raises once the layer never comes

    def __init__(self) -> None:
        self.layers = 0
        self.error: str | None = None
        self._changed = asyncio.Event()

    def _set(self, layers: int) -> None:
        self.layers = max(self.layers, layers)
        self._changed.set()

    def _fail(self, why: str) -> None:
        if self.error is None:
            self.error = why
        self._changed.set()

    async def ready(self, layer: int) -> None:
        while self.layers <= layer:
            if self.error is not None:
                raise self.failure(f"hit KV of layer {layer}: {self.error}")
            self._changed.clear()
            await self._changed.wait()


class LocalArrivals(_Counted):
    """Layers this node writes: :meth:`landed` (n layers in place) or :meth:`failed`."""

    def landed(self, layers: int) -> None:
        self._set(layers)

    def failed(self, why: str) -> None:
        self._fail(why)


class RemoteWatch(_Counted):
    """Follows a WatchTransfers stream (``call``) of a DE writing our hit KV.
    ``loaded_blocks``: the leading hit blocks the DE read intact (known once a layer is
    in place); the prefill computes the rest. A broken stream is the peer's failure."""

    failure = PeerUnavailable

    def __init__(self, call, peer: str):
        super().__init__()
        self.call = call
        self.peer = peer
        self.loaded_blocks = 0
        self.complete = False            # the DE said every layer landed: it writes no more
        # Where the DE may WRITE in our buffer (a transfer Grant), until it is complete.
        self.scope = None
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        try:
            async for prog in self.call:
                if prog.layers_done > 0:
                    self.loaded_blocks = prog.loaded_blocks
                self.complete = self.complete or prog.complete
                if self.complete and self.scope is not None:
                    self.scope.close()
                self._set(prog.layers_done)
        except grpc.aio.AioRpcError as e:
            self._fail(f"{self.peer}: {e.code().name} {e.details()}")
        self._fail(f"{self.peer}: the transfer stream ended")

    def close(self) -> None:
        self.call.cancel()
        self.task.cancel()
        if self.scope is not None:
            self.scope.close()           # a late WRITE of the DE is refused from here
