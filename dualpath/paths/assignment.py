"""An assignment as the node's paths see it: converted from the scheduler's protobuf once,
at the leader's fetch (the RPC edge), so domain code never touches protobuf."""

from __future__ import annotations

from dataclasses import dataclass

from dualpath.errors import UsageError
from dualpath.paths.payload import Payload
from dualpath.roles import ReadSide
from dualpath.v1 import scheduler_pb2


@dataclass(frozen=True)
class Assignment:
    """One request's (PE, DE, read side) as the scheduler chose them (paper §6.1)."""

    request_id: str
    prefill_engine_id: str
    decode_engine_id: str
    read_side: ReadSide
    prompt_tokens: int
    hit_tokens: int
    max_new_tokens: int
    prefill_read_tokens: int        # hit tokens the PE's node reads (split reads: a part)
    decode_read_tokens: int         # hit tokens the DE's node reads
    decode_address: str             # the DE node's control address
    payload: Payload
    payload_bytes: bytes            # the wire form, forwarded to the DE untouched
    attempt: int = 0                # which execution (scheduler.proto Assignment.attempt)
    decode_identity: str = ""       # who registered the DE's group: who may stop it here
    submitter_identity: str = ""    # whom its tokens go to (the sink must answer as it)

    @classmethod
    def from_pb(cls, a: scheduler_pb2.Assignment) -> Assignment:
        """Raises UsageError for a malformed payload or read side (the leader fails that
        request)."""
        try:
            side = ReadSide(a.read_side)
        except ValueError:
            raise UsageError(f"assignment of {a.request_id}: read side {a.read_side} "
                             "names none") from None
        return cls(a.request_id, a.prefill_engine_id, a.decode_engine_id, side,
                   int(a.prompt_tokens), int(a.hit_tokens), int(a.max_new_tokens),
                   int(a.prefill_read_tokens), int(a.decode_read_tokens),
                   a.decode_control_address, Payload.decode(a.payload), a.payload,
                   int(a.attempt), a.decode_identity,
                   a.submitter_identity)


def split_blocks(read_policy: str, read_side: ReadSide, hit: int, prefill_read_tokens: int,
                 decode_read_tokens: int, block_tokens: int) -> tuple[int, int]:
    """(blocks this PE reads, blocks the DE reads) of a ``hit``-block hit (pure)."""
    if hit <= 0 or read_policy == "none":
        return 0, 0
    if read_policy == "prefill":
        return hit, 0
    if read_policy == "decode":
        return 0, hit
    if read_policy == "split":
        return hit // 2, hit - hit // 2
    if read_side == ReadSide.DECODE:
        return 0, hit
    if read_side == ReadSide.SPLIT:
        total = prefill_read_tokens + decode_read_tokens
        local = round(hit * prefill_read_tokens / total) if total else hit
        return local, hit - local
    return hit, 0

