"""An assignment crosses from protobuf once, at the leader's fetch: its read side becomes a
:class:`~dualpath.roles.ReadSide`, and a value that names none is refused there."""

import pytest

from dualpath.errors import UsageError
from dualpath.paths.assignment import Assignment
from dualpath.paths.payload import Payload
from dualpath.roles import ReadSide
from dualpath.v1 import scheduler_pb2


def _pb(read_side: int) -> scheduler_pb2.Assignment:
    return scheduler_pb2.Assignment(
        request_id="r1", prefill_engine_id="p0/e0", decode_engine_id="d0/e0",
        read_side=read_side, prompt_tokens=300, hit_tokens=128, max_new_tokens=4,
        decode_control_address="127.0.0.1:9", attempt=2,
        payload=Payload("t0", 0, 300, 128, 4).encode())


def test_the_read_side_becomes_our_enum():
    a = Assignment.from_pb(_pb(scheduler_pb2.READ_SIDE_SPLIT))
    assert a.read_side is ReadSide.SPLIT and a.attempt == 2


@pytest.mark.parametrize("side", [5, 99])
def test_a_read_side_that_names_none_is_refused_at_the_edge(side):
    with pytest.raises(UsageError, match=f"read side {side} names none"):
        Assignment.from_pb(_pb(side))
