"""A vLLM decode node streams a request's tokens to its sink only once the scheduler
assigned the request there, and then only to its submitter (issue 38: a node that
prepared a request of its own choosing, with a live request's id and sink, and sent
PrefillDone, had the DE stream tokens into that request). Before this, the stream
started at PrefillDone whatever the DE had been assigned."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from dualpath.engines.vllm.decode import _Streamer


class _Peers:
    def __init__(self):
        self.sent: list[tuple[str, list[int], str]] = []

    async def partial(self, sink, request_id, attempt, offset, ids, lps, top, expect=""):
        self.sent.append((sink, list(ids), expect))


def test_tokens_wait_for_the_assignment_and_go_to_the_submitter_only():
    async def main():
        peers = _Peers()
        st = SimpleNamespace(request_id="r1", attempt=1, assigned_here=False,
                             sink_identity="")
        s = _Streamer(SimpleNamespace(peers=peers), st, "sink:1")
        s.grew([7, 8], [0.0, 0.0], [None, None])
        await asyncio.sleep(0.2)
        before = list(peers.sent)                  # not assigned here: nothing sent
        st.sink_identity, st.assigned_here = "client/fe", True
        s.grew([7, 8, 9], [0.0] * 3, [None] * 3)
        await s.close()
        return before, peers.sent

    before, sent = asyncio.run(main())
    assert before == []
    assert sent == [("sink:1", [7, 8, 9], "client/fe")]


def test_a_request_never_assigned_here_streams_nothing():
    async def main():
        peers = _Peers()
        st = SimpleNamespace(request_id="r1", attempt=1, assigned_here=False,
                             sink_identity="")
        s = _Streamer(SimpleNamespace(peers=peers), st, "sink:1")
        s.grew([1, 2, 3], [0.0] * 3, [None] * 3)
        await s.close()
        return peers.sent

    assert asyncio.run(main()) == []
