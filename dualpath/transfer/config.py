"""The ``[transfer]`` config section: the TransferEngine's policy knobs and the TCP
provider's socket settings (the transport choice itself is ``[transport]``)."""

from __future__ import annotations

from dataclasses import dataclass

from dualpath.config import key


@dataclass(frozen=True)
class TransferConfig:
    """How the TransferEngine slices, spreads, bounds and retries WRITEs."""

    connections_per_peer: int = key(2, "QPs (or TCP connections) per peer; batches "
                                    "go to the least busy one, large ones are spread "
                                    "over them all.", min=1, max=64)
    spread_min_bytes: int = key(4 << 20, "A batch (one write(): a layer of a request) "
                                "of at least this many bytes is spread over the peer's "
                                "connections; a smaller one goes whole to one, so it "
                                "costs one post and one completion whatever its block "
                                "count. 4 MiB is ~350 us on one 100 Gb/s QP, against "
                                "~10 us of Python for each extra post.", min=1,
                                max=1 << 40)
    slice_bytes: int = key(1 << 20, "Items longer than this are cut into slices of at "
                           "most this many bytes.", min=4096, max=1 << 30)
    max_send_wr: int = key(256, "WRITEs outstanding per connection (its credits).",
                           min=1, max=65536)
    signal_every: int = key(128, "Signal (ask a completion for) every Nth WRITE; the last "
                            "of each post is always signalled. Each completion is a step "
                            "of Python on the data-path thread: 128 (half the default "
                            "credits, which come back in two halves) keeps a DS 660B layer "
                            "of 512 blocks at four.", min=1, max=65536)
    cq_depth: int = key(4096, "Completion queue depth: signalled WRITEs outstanding over "
                        "all connections.", min=1, max=1 << 22)
    timeout_s: float = key(30.0, "Bound on one write() (seconds); past it the write "
                           "raises TransferTimeout and its connections are recovered.",
                           min=0.001)
    max_retries: int = key(2, "Times a slice is re-posted after its connection failed "
                           "and recovered (access errors are never retried).", min=0, max=100)
    connect_timeout_s: float = key(5.0, "Bound on connecting one connection (seconds).",
                                   min=0.001)
    recover_attempts: int = key(3, "Reconnect attempts (with backoff) after a connection "
                                "error before its pending writes fail.", min=1, max=100)
    tcp_listen: str = key("127.0.0.1", "TCP provider: address to listen on.")
    tcp_port: int = key(0, "TCP provider: port to listen on; 0 = any free port.",
                        min=0, max=65535)
    tcp_advertise: str = key("", "TCP provider: address peers connect to; empty = "
                             "tcp_listen.")
    tcp_sockbuf_bytes: int = key(0, "TCP provider: SO_SNDBUF/SO_RCVBUF; 0 = kernel "
                                 "autotuning (best on loopback).", min=0, max=1 << 30)
    tcp_user_timeout_ms: int = key(10000, "TCP provider: TCP_USER_TIMEOUT, after which "
                                   "unacknowledged data fails the connection; 0 = kernel "
                                   "default.", min=0, max=1 << 30)
