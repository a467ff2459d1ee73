"""The emulated engine: a model that is a cost model, and "HBM" that is our own memory.

Kept for benchmarks at scale, where a real engine cannot run (and labelled emulated
wherever it reports). Each engine rank has an "HBM" region of the node's pinned memory,
registered with the node's transfer engine as ``hbm<rank>`` and cut into slots (its
placement is :meth:`EngineRank.placement`): Layer Block slots on a PE, whose forward
allocates HBM a layer at a time (engines/emulated/forward.py), Full Block slots on a DE. Compute
is the cost model's time (dualpath/kv/cost.py: a PE's forward steps, a DE's decode
steps), and computed KV is the deterministic synthetic KV of dualpath/kv/synth.py, so
the DE can verify every byte.

The real engine (vLLM) is dualpath/engines/vllm/engine.py: its ranks' memory belongs to
its worker processes and its compute is the model's. Both are seen by the paths through
:class:`EngineRank` (identity, scheduler-facing counts, KV memory).

Threads: the node's event loop.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Iterator, Sequence

import numpy as np

from dualpath.buffers.pool import Reservation
from dualpath.kv import cost
from dualpath.kv.placement import KvFormat
from dualpath.kv.profiles import ModelProfile
from dualpath.kv.synth import SyntheticKV
from dualpath.paths.kvplan import BlockSpan, layer_runs


class EmulatedEngine:
    """The cost model and the synthetic KV of a node's emulated engines."""

    kind = "emulated"

    def __init__(self, profile: ModelProfile, speed_scale: float,
                 verify_fraction: float = 1.0):
        self.profile = profile
        self.speed_scale = speed_scale
        self.verify_fraction = verify_fraction
        self.synth: SyntheticKV | None = None
        self.fmt: KvFormat | None = None
        #: A counter labelled by work ("synth", "verify") the emulator's CPU seconds go
        #: to (the node's metrics), or None.
        self.cpu_counter = None

    def verifies(self, request_id: str) -> bool:
        """Whether the DE checks this request's prompt KV byte by byte: all of them at
        ``verify_fraction`` 1, else those whose id hashes below the fraction (the same
        choice on every run)."""
        if self.verify_fraction >= 1.0:
            return True
        h = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
        return int.from_bytes(h, "little") < self.verify_fraction * 2.0 ** 64

    @contextlib.contextmanager
    def spent(self, work: str) -> Iterator[None]:
        """Count the calling thread's CPU time inside the block as emulator ``work``."""
        t0 = time.thread_time()
        try:
            yield
        finally:
            if self.cpu_counter is not None:
                self.cpu_counter.labels(work).inc(time.thread_time() - t0)

    def bind(self, fmt: KvFormat, synth: SyntheticKV) -> None:
        self.fmt, self.synth = fmt, synth

    def describe(self) -> str:
        return f"emulated (cost model of {self.profile.name}, speed x{self.speed_scale:g})"

    # ------------------------------------------------------------ prefill

    def attention_s(self, batch: Sequence[tuple[int, int]]) -> float:
        """Seconds one forward pass of ``batch`` ((cached, new) token pairs) spends in
        attention on one engine: what a PE times when it profiles its engine."""
        return cost.forward_time(self.profile, batch).attention_s

    def write_layer_kv(self, res: Reservation, slots: Sequence[int],
                       spans: list[BlockSpan], layer: int, first: int, stop: int) -> None:
        """The (synthetic) KV layer ``layer`` computed for tokens ``[first, stop)``,
        into Layer Block slots: block ``b`` in ``res.flat(slots[b])``."""
        lay = self.synth.layout
        TB = lay.token_bytes
        with self.spent("synth"):
            for b, s0, s1 in layer_runs(first, stop, lay.tokens):
                view = res.flat(slots[b])[s0 * TB: s1 * TB]
                self.synth.fill_layer(view, spans[b].key, layer, s0)

    # ------------------------------------------------------------ decode

    def decode_step_s(self, contexts: Sequence[int]) -> float:
        """Seconds of one decode step of a batch holding ``contexts`` tokens per request."""
        return cost.decode_step_s(self.profile, contexts)

    def fill_block(self, out: np.ndarray, key: bytes) -> None:
        """A block the generated tokens completed: the model's (synthetic) KV for it."""
        with self.spent("synth"):
            self.synth.fill_full(out, key)
