"""What one request's KV is, in blocks and layers: pure helpers the PE, the DE and the
tests share (no I/O).

A request carries a :class:`Payload` (JSON in the scheduler's opaque ``payload`` bytes):
the trajectory and round it replays, the mode, and where to report timings. Its token
ids are derived (dualpath/trace/model.py) or carried explicitly for real traces.

Block ``i`` of a prompt covers tokens ``[i*T, (i+1)*T)``; full blocks are keyed by the
chained prefix key (dualpath/kv/prefix.py); the trailing partial block, which is never
stored, is keyed by the same chain over its partial tokens, so its synthetic KV is as
deterministic as the rest. Every byte of the prompt's KV is therefore a pure function of
its tokens, which is what lets the DE verify all of it.
"""

from __future__ import annotations

import base64
import json
from dataclasses import asdict, dataclass

import numpy as np

from dualpath.errors import UsageError
from dualpath.kv.prefix import ROOT_KEY, chain_key
from dualpath.trace.model import synthetic_token_ids, trajectory_key

MODES = ("basic", "dualpath", "oracle")
# How the PE turns the scheduler's read side into the one it acts on.
READ_POLICIES = ("scheduler", "prefill", "round_robin", "none")
MODE_READ_POLICY = {"basic": "prefill", "dualpath": "scheduler", "oracle": "none"}


@dataclass(frozen=True)
class Payload:
    trajectory: str
    round: int
    prompt_tokens: int
    hit_tokens: int
    gen_tokens: int
    mode: str = "dualpath"
    sink: str = ""                    # host:port of the replay client's ReplaySink; "" = none
    layerwise: bool = True            # overlap layer l+1's transfers with layer l's compute
    read_policy: str = "scheduler"    # READ_POLICIES
    token_ids_b64: str = ""           # explicit stream ids (int32 LE) for real traces

    def __post_init__(self):
        if self.mode not in MODES:
            raise UsageError(f"payload: mode {self.mode!r}; allowed: {', '.join(MODES)}")
        if self.read_policy not in READ_POLICIES:
            raise UsageError(f"payload: read_policy {self.read_policy!r}; allowed: "
                             f"{', '.join(READ_POLICIES)}")
        if not 0 <= self.hit_tokens < self.prompt_tokens or self.gen_tokens < 1:
            raise UsageError(f"payload: need 0 <= hit < prompt and gen >= 1, got "
                             f"{self.hit_tokens}, {self.prompt_tokens}, {self.gen_tokens}")

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> Payload:
        try:
            return cls(**json.loads(data))
        except (ValueError, TypeError) as e:
            raise UsageError(f"malformed request payload: {e}") from None

    @property
    def oracle(self) -> bool:
        return self.mode == "oracle"

    def token_ids(self, stop: int) -> np.ndarray:
        """Ids of stream positions ``[0, stop)`` (prompt, or prompt + generation)."""
        if self.token_ids_b64:
            ids = np.frombuffer(base64.b64decode(self.token_ids_b64), dtype="<i4")
            if stop > ids.size:
                raise UsageError(f"payload carries {ids.size} token ids, {stop} needed")
            return ids[:stop].astype(np.int64)
        return synthetic_token_ids(trajectory_key(self.trajectory), 0, stop)


def encode_token_ids(ids: np.ndarray) -> str:
    return base64.b64encode(np.asarray(ids, dtype="<i4").tobytes()).decode()


@dataclass(frozen=True)
class BlockSpan:
    """Block ``index`` of a token sequence: its key and how many tokens it holds."""

    index: int
    key: bytes
    tokens: int       # == block_tokens except for a trailing partial block


def block_spans(tokens: np.ndarray, block_tokens: int) -> list[BlockSpan]:
    """Every block of ``tokens``, the trailing partial one included (see module doc)."""
    spans = []
    parent = ROOT_KEY
    n = len(tokens)
    for i, start in enumerate(range(0, n, block_tokens)):
        part = tokens[start:start + block_tokens]
        key = chain_key(parent, part)
        spans.append(BlockSpan(i, key, len(part)))
        parent = key
    return spans


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
