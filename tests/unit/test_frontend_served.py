"""What the front end tells a client about its request (pure)."""

from __future__ import annotations

from dualpath.frontend.served import read_side, served
from dualpath.scheduler.generate import Generated


def _g(**kw) -> Generated:
    base = {"request_id": "r", "token_ids": [1, 2, 3, 4, 5], "logprobs": [0.0] * 5,
            "attempt": 2, "prefill_node_id": "p0", "decode_node_id": "d1",
            "prefill_read_bytes": 0, "decode_read_bytes": 0, "submit_unix_s": 100.0,
            "first_token_unix_s": 100.5, "second_token_unix_s": 100.6,
            "finish_unix_s": 101.3}
    return Generated(**{**base, **kw})


def test_the_read_side_follows_the_bytes_each_side_read():
    assert read_side(0, 0) == "none"
    assert read_side(10, 0) == "prefill"
    assert read_side(0, 10) == "decode"
    assert read_side(10, 10) == "split"


def test_a_report_carries_the_hit_bytes_nodes_and_latencies():
    s = served(_g(prefill_read_bytes=300, decode_read_bytes=200), 1000, 768)
    assert (s.read_side, s.prompt_tokens, s.hit_tokens, s.loaded_bytes) == \
        ("split", 1000, 768, 500)
    assert (s.prefill_node, s.decode_node, s.attempt) == ("p0", "d1", 2)
    assert abs(s.ttft_s - 0.5) < 1e-9 and abs(s.tpot_s - 0.2) < 1e-9
    h = s.headers()
    assert h["X-DualPath-Read-Side"] == "split" and h["X-DualPath-Hit-Tokens"] == "768"
    assert h["X-DualPath-Loaded-Bytes"] == "500" and h["X-DualPath-Decode-Node"] == "d1"
    one = served(_g(token_ids=[7], logprobs=[0.0]), 10, 0)
    assert one.tpot_s == 0.0 and one.read_side == "none"


def test_queue_time_is_submission_to_a_prefill_node_taking_it_up():
    assert abs(served(_g(assigned_unix_s=100.25), 10, 0).queue_s - 0.25) < 1e-9
    assert served(_g(), 10, 0).queue_s == 0.0          # not said: not counted
