"""A cancelled layer-by-layer move gives its writes in flight up instead of waiting
them out (transfer/kvio.write_layers): a request dropped while its KV went to a peer that
was cut off held its task, its slots and its next attempt for the write's whole bound
(transfer.timeout_s, 30 s by default), the soak's slowest recoveries. Each write given
up returns once the transfer engine stopped it (tests/integration/test_tcp_transfer.py
checks that half), so when write_layers returns, nothing it posted is on the wire."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np

from dualpath.transfer import kvio


class StuckWire:
    """A transfer engine whose writes never complete: a peer cut off. A cancelled write
    records that it was given up, after a moment (the reset), then raises."""

    def __init__(self):
        self.started: list[int] = []
        self.given_up: list[int] = []

    async def rescope(self, peer):
        pass

    async def write(self, peer, rows, *, local, remote):
        layer = int(rows[0, 0])
        self.started.append(layer)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await asyncio.sleep(0.01)          # the data-path thread resets the connection
            self.given_up.append(layer)
            raise


def test_a_cancel_gives_the_writes_in_flight_up_and_returns_once_they_stopped(monkeypatch):
    class Move:
        def __init__(self, *a):
            pass

        def rows(self, layer):
            return "src", "dst", np.array([[layer, 0, 8]], dtype=np.uint64)
    monkeypatch.setattr(kvio, "LayerMove", Move)

    async def main():
        wire = StuckWire()
        fmt = SimpleNamespace(fmt=SimpleNamespace(layers=4))
        task = asyncio.ensure_future(kvio.write_layers(wire, "pe", fmt, [0], fmt, [0], 0, 16))
        await asyncio.sleep(0.05)
        assert wire.started == [0, 1]          # two layers in flight
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=5)
        assert done, "write_layers waited for writes that never complete"
        assert task.cancelled()
        assert sorted(wire.given_up) == [0, 1]  # both stopped before it returned
        assert wire.started == [0, 1]          # and no later layer began
    asyncio.run(main())
