"""What happened to a request, as its client and the front end's /metrics see it.

A request's report (pure): which side read its hit from storage, how many prompt tokens
were a hit, the bytes read, the prefill and decode nodes, the attempt that served it.
It goes back as response headers (``X-DualPath-*``) on a plain answer, and as an SSE
comment line (``: dualpath {json}``, which OpenAI clients skip) before a stream's
``[DONE]``: no answer field differs from vLLM's own server.

:class:`FrontendMetrics`: the front end's Prometheus families, served at its /metrics.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dualpath import metrics as m
from dualpath.scheduler.generate import Generated


@dataclass(frozen=True)
class Served:
    read_side: str            # prefill, decode, split, none (no storage read: no hit, or
    #                           every hit block still in a node's DRAM)
    prompt_tokens: int
    hit_tokens: int           # the stored prefix the front end planned as a hit
    loaded_bytes: int         # hit KV read from storage (both sides)
    prefill_node: str
    decode_node: str
    attempt: int
    ttft_s: float
    tpot_s: float
    queue_s: float = 0.0      # submission to a prefill node taking it up (0: not said)

    def headers(self) -> dict[str, str]:
        return {"X-DualPath-Read-Side": self.read_side,
                "X-DualPath-Hit-Tokens": str(self.hit_tokens),
                "X-DualPath-Loaded-Bytes": str(self.loaded_bytes),
                "X-DualPath-Prefill-Node": self.prefill_node,
                "X-DualPath-Decode-Node": self.decode_node,
                "X-DualPath-Attempt": str(self.attempt)}

    def as_dict(self) -> dict:
        return asdict(self)


def read_side(prefill_bytes: int, decode_bytes: int) -> str:
    if prefill_bytes and decode_bytes:
        return "split"
    if prefill_bytes:
        return "prefill"
    return "decode" if decode_bytes else "none"


def served(g: Generated, prompt_tokens: int, hit_tokens: int) -> Served:
    n = len(g.token_ids)
    ttft = max(0.0, g.first_token_unix_s - g.submit_unix_s) if g.first_token_unix_s else 0.0
    tpot = (max(0.0, g.finish_unix_s - g.first_token_unix_s) / (n - 1)
            if n > 1 and g.first_token_unix_s else 0.0)
    queue = max(0.0, g.assigned_unix_s - g.submit_unix_s) if g.assigned_unix_s else 0.0
    return Served(read_side(g.prefill_read_bytes, g.decode_read_bytes), prompt_tokens,
                  hit_tokens, g.prefill_read_bytes + g.decode_read_bytes,
                  g.prefill_node_id, g.decode_node_id, g.attempt, ttft, tpot, queue)


class FrontendMetrics:
    def __init__(self, registry):
        self.requests = m.counter(registry, "dualpath_frontend_requests_total",
                                  "Requests answered, by HTTP status.", ("status",))
        self.ttft = m.histogram(registry, "dualpath_frontend_ttft_seconds",
                                "Submission to first token of a served request.")
        self.tpot = m.histogram(registry, "dualpath_frontend_tpot_seconds",
                                "Time per output token after the first.")
        self.queue = m.histogram(registry, "dualpath_frontend_queue_seconds",
                                 "Submission to a prefill node taking the request up "
                                 "(the scheduler's queues and any retries).")
        self.prompt_tokens = m.counter(registry, "dualpath_frontend_prompt_tokens_total",
                                       "Prompt tokens of served requests.")
        self.hit_tokens = m.counter(
            registry, "dualpath_frontend_hit_tokens_total",
            "Of those, tokens of a stored prefix (hit ratio = hit / prompt).")
        self.by_side = m.counter(registry, "dualpath_frontend_read_side_requests_total",
                                 "Served requests by the side that read their hit: "
                                 "prefill, decode, split or none.", ("side",))
        self.loaded_bytes = m.counter(registry, "dualpath_frontend_loaded_bytes_total",
                                      "Hit KV bytes read from storage for served requests.")
        self.in_flight = m.gauge(registry, "dualpath_frontend_requests_in_flight",
                                 "Requests being served now.")

    def observe(self, s: Served) -> None:
        self.ttft.observe(s.ttft_s)
        if s.tpot_s:
            self.tpot.observe(s.tpot_s)
        if s.queue_s:
            self.queue.observe(s.queue_s)
        self.prompt_tokens.inc(s.prompt_tokens)
        self.hit_tokens.inc(s.hit_tokens)
        self.by_side.labels(s.read_side).inc()
        self.loaded_bytes.inc(s.loaded_bytes)
