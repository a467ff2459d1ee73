"""One request's KV in blocks, and the routes its layers take (pure code, no I/O).

Block ``i`` of a prompt covers tokens ``[i*T, (i+1)*T)``; full blocks are keyed by the
chained prefix key (dualpath/kv/prefix.py); the trailing partial block, which is never
stored, is keyed by the same chain over its partial tokens, so the emulated engine's
synthetic KV is as deterministic as the rest (and the DE can verify all of it).

A :class:`PrefillPlan` is one attempt's plan on its PE, built once from the assignment:
the prompt's blocks and the hit blocks each side reads; an engine that learns more (what
is stored now, what its instance holds) derives a new one (:meth:`PrefillPlan.
with_parts`), never edits it. A :class:`DecodePlan` is the same attempt's plan on its DE,
built once from the PrepareRequest: the blocks, those its instance holds, its slots.

A :class:`Route` is one path a request's KV takes between two memories: a placement and
the request's units on each side (dualpath/kv/placement.py). Every WRITE of every read
path comes from a route's :meth:`Route.runs`; nobody computes an offset by hand.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from dualpath.kv.placement import KvPlacement, LayerMove, Run, runs
from dualpath.kv.prefix import ROOT_KEY, chain_key


@dataclass(frozen=True)
class BlockSpan:
    """Block ``index`` of a token sequence: its key and how many tokens it holds."""

    index: int
    key: bytes
    tokens: int       # == block_tokens except for a trailing partial block


def block_spans(tokens: np.ndarray, block_tokens: int,
                root: bytes = ROOT_KEY) -> list[BlockSpan]:
    """Every block of ``tokens``, the trailing partial one included (see module doc),
    chained from ``root`` (the request's tenant's: dualpath/kv/prefix.py tenant_root)."""
    spans = []
    parent = root
    n = len(tokens)
    for i, start in enumerate(range(0, n, block_tokens)):
        part = tokens[start:start + block_tokens]
        key = chain_key(parent, part)
        spans.append(BlockSpan(i, key, len(part)))
        parent = key
    return spans


@dataclass(frozen=True)
class PrefillPlan:
    """One attempt of a request on its PE: its prompt's blocks (``spans``, the partial
    last one included) and which hit blocks each side reads: ``[0, local)`` this node,
    ``[local, local + remote)`` the DE (paper §4: the PE read, the DE read, a split)."""

    request_id: str
    prompt_tokens: int
    block_tokens: int
    spans: tuple[BlockSpan, ...]
    local: int
    remote: int
    token_ids: np.ndarray = field(compare=False, repr=False)    # the prompt's

    @property
    def hit_blocks(self) -> int:
        return self.local + self.remote

    @property
    def keys(self) -> list[bytes]:
        """Every prompt block's key, the partial last one's too."""
        return [s.key for s in self.spans]

    @property
    def full_keys(self) -> list[bytes]:
        """The prompt's full blocks' keys (what storage holds)."""
        return [s.key for s in self.spans[:self.prompt_tokens // self.block_tokens]]

    @property
    def tail_keys(self) -> list[bytes]:
        """The partial last block's key, if the prompt ends inside a block."""
        return [self.spans[-1].key] if self.prompt_tokens % self.block_tokens else []

    @property
    def read_tokens(self) -> int:
        """Hit tokens this node reads (its read queue counts them)."""
        return self.local * self.block_tokens

    @property
    def decode_read_tokens(self) -> int:
        """Hit tokens the DE reads for this node (PrepareRequest.decode_read_tokens)."""
        return self.remote * self.block_tokens

    def with_parts(self, local: int, remote: int) -> PrefillPlan:
        """The same request, its hit read in other parts (never more than planned)."""
        if local < 0 or remote < 0 or local + remote > self.hit_blocks:
            raise ValueError(f"{self.request_id}: parts ({local}, {remote}) exceed the "
                             f"planned hit of {self.hit_blocks} blocks")
        return replace(self, local=local, remote=remote)


@dataclass(frozen=True)
class DecodePlan:
    """One attempt of a request on its DE, built once from its PrepareRequest: the
    prompt's blocks (``spans``, the partial last one included), the leading ones the
    decode instance holds already (``held``: the PE sends none of them), the first block
    with a DE-buffer slot (``base``: slot i holds block base + i) and the hit blocks this
    node reads for the PE (``reads``, from block 0 on: they need slots, held or not)."""

    request_id: str
    attempt: int
    prompt_tokens: int
    block_tokens: int
    spans: tuple[BlockSpan, ...]
    moves_kv: bool                  # False: an oracle request (no slots, nothing moved)
    held: int = 0
    reads: int = 0

    def __post_init__(self):
        if not 0 <= self.held < max(1, len(self.spans)):
            raise ValueError(f"{self.request_id}: {self.held} held blocks of "
                             f"{len(self.spans)}; one at least must come from the PE")
        if self.held and not self.moves_kv:
            raise ValueError(f"{self.request_id}: an oracle request holds no blocks")

    @property
    def base(self) -> int:
        """The first prompt block with a slot (0 when this node reads for the PE)."""
        return 0 if self.reads else self.held

    @property
    def slots(self) -> int:
        """DE-buffer slots the attempt reserves."""
        return len(self.spans) - self.base if self.moves_kv else 0


def decode_plan(request_id: str, attempt: int, prompt_tokens: int, block_tokens: int,
                spans: Sequence[BlockSpan], moves_kv: bool, held: int,
                read_tokens: int) -> DecodePlan:
    """A DE's plan (pure): ``held`` is what the engine says it likely holds, capped so
    the last block comes from the PE (its first token is computed there)."""
    held = max(0, min(held, len(spans) - 1)) if moves_kv else 0
    return DecodePlan(request_id, attempt, prompt_tokens, block_tokens, tuple(spans),
                      moves_kv, held, blocks_for(read_tokens, block_tokens))


def blocks_for(tokens: int, block_tokens: int) -> int:
    return -(-tokens // block_tokens)


def layer_runs(first_token: int, stop_token: int, block_tokens: int):
    """``(block index, token start in block, token stop in block)`` covering
    ``[first_token, stop_token)``."""
    t = first_token
    while t < stop_token:
        b, s = divmod(t, block_tokens)
        e = min(block_tokens, s + stop_token - t)
        yield b, s, e
        t += e - s


@dataclass(frozen=True)
class Route:
    """Where a request's blocks live on two sides: ``src_units[i]`` / ``dst_units[i]``
    hold its tokens ``[i*T, (i+1)*T)`` (T = the placements' unit tokens)."""

    src: KvPlacement
    src_units: Sequence[int]
    dst: KvPlacement
    dst_units: Sequence[int]

    def runs(self, layer: int, first_token: int, stop_token: int) -> list[Run]:
        """The WRITE runs of layer ``layer``, tokens ``[first_token, stop_token)``."""
        return runs(self.src, self.src_units, self.dst, self.dst_units, layer, first_token,
                    stop_token)

    def move(self, spans: Sequence[tuple[int, int]]) -> LayerMove:
        """The WRITE runs of each token span ``[lo, hi)`` of ``spans``, layer by layer
        (placement.LayerMove: computed once, no Python step per block)."""
        return LayerMove(self.src, self.src_units, self.dst, self.dst_units, spans)
