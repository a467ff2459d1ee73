"""Config sections ``[scheduler]`` (the daemon) and ``[scheduler_client]`` (leaders, CLI)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dualpath.config import U32_MAX, key
from dualpath.errors import ConfigError
from dualpath.kv.profiles import PROFILES
from dualpath.rpc import check_listen


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler daemon: where it listens, the model and rates its policy constants
    come from (paper §6, A.4), leases, security and metrics."""

    listen: str = key("127.0.0.1:50051", "gRPC listen address host:port (port 0 = any free "
                      "port); `dualpath scheduler --listen` overrides it.")
    model_profile: str = key("ds660b", "Model profile the cost model and HBM accounting use "
                             "(dualpath.kv.profiles).", choices=tuple(sorted(PROFILES)))
    storage_read_bytes_per_s: float = key(
        50e9, "Storage read rate of one node in bytes/s (a 400 Gbps storage NIC, paper §7); "
        "α derives from it, and it sizes split reads when a group registers no rate.", min=1.0)
    alpha_window_s: float = key(3.0, "α = tokens one node reads in this many seconds "
                                "(paper A.4: 3 s).", min=0.001)
    beta_window_s: float = key(5.0, "β = prompt tokens one GPU prefills in this many seconds "
                               "(paper A.4: 5 s).", min=0.001)
    alpha_tokens: int = key(0, "Short read-queue threshold α in tokens; 0 = derive from "
                            "storage_read_bytes_per_s and alpha_window_s.", min=0)
    beta_tokens: int = key(0, "Unfinished-token cap β per PE in tokens; 0 = derive from the "
                           "model profile and beta_window_s.", min=0)
    reference_context_tokens: int = key(
        32721, "Prompt length of the typical request β is derived with (paper Table 2, 64K "
        "trace: mean context).", min=1)
    reference_append_tokens: int = key(
        429, "New (uncached) tokens of that typical request (Table 2, 64K trace: mean "
        "append).", min=1)
    compute_quota_ms: int = key(300, "PE forward-batch compute quota handed to engines "
                                "(paper §6.2, A.4: 300 ms).", min=1, max=60000)
    split_read: bool = key(False, "Read a request's hit KV from both nodes, sized so both "
                           "read queues drain together (beyond the paper, its future work).")
    split_min_saving_ms: int = key(50, "A split read must end a request's reads at least "
                                   "this much sooner than the better node alone would "
                                   "(read queues over read rates), else one node reads it: "
                                   "a split costs a second set of reads and a PE<-DE hop, "
                                   "which an idle storage NIC never pays back.", min=0,
                                   max=U32_MAX)
    lease_ms: int = key(3000, "A group whose leader is silent this long is marked down and "
                        "its unfinished requests are requeued at the head (uint32 on the wire).",
                        min=10, max=U32_MAX)
    fetch_interval_ms: int = key(20, "Fetch period suggested to leaders at registration "
                                 "(uint32 on the wire).", min=1, max=U32_MAX)
    max_assignments_per_fetch: int = key(4096, "Upper bound on assignments in one fetch "
                                         "answer.", min=1)
    max_queued_requests: int = key(1_000_000, "Requests submitted beyond this many waiting "
                                   "ones are rejected (reason QUEUE_FULL).", min=1)
    max_held_bytes: int = key(2 << 30, "The queue bounded by bytes: requests whose ids, "
                              "payloads and bookkeeping (~1.7 KiB each) would take the live "
                              "requests past this are rejected (QUEUE_FULL).", min=1 << 20)
    max_payload_bytes: int = key(256 << 10, "Largest request payload accepted (a larger one "
                                 "is rejected, reason INVALID). At most 2 MiB, so that one "
                                 "assignment always fits a fetch reply.", min=0, max=2 << 20)
    max_submit_requests: int = key(4096, "Requests in one SubmitRequest call; more and the "
                                   "call is refused whole (INVALID_ARGUMENT). At most 8192, "
                                   "so that the per-request reply fits a 4 MiB message.",
                                   min=1, max=8192)
    journal_file: str = key("", "SQLite file (WAL mode) of the durable state: submissions, "
                            "attempts and outcomes survive a restart, and SubmitRequest "
                            "answers only once they are on disk (docs/reliability.md). Empty "
                            "= off: a restart loses every queued and running request.")
    journal_sync: str = key("normal", "normal: a commit survives the scheduler being killed "
                            "at any instant; full: also power loss (an fsync per call that "
                            "changes durable state).", choices=("normal", "full"))
    max_failed_attempts: int = key(5, "A request whose attempts failed this many times (a "
                                   "FAILED report) ends FAILED, reported to its submitter.",
                                   min=1, max=U32_MAX)
    max_lost_attempts: int = key(20, "A request whose attempts were lost this many times "
                                 "with a node whose lease lapsed (killed, frozen or cut off "
                                 "while it held the request: the node's fault, counted "
                                 "apart from failures) ends FAILED.", min=1, max=U32_MAX)
    retry_backoff_ms: int = key(100, "Backoff after a request's first failed attempt; it "
                                "doubles with each further failure, jittered to between "
                                "half and all of it.", min=0, max=U32_MAX)
    retry_backoff_max_ms: int = key(5000, "Upper bound of that backoff.", min=0,
                                    max=U32_MAX)
    peer_avoid_ms: int = key(3000, "After a failed attempt the request avoids the groups "
                             "blamed for it this long, unless they register again (a new "
                             "lease); then it may go back (a one-node side recovers).",
                             min=0, max=U32_MAX)
    finished_requests_kept: int = key(100_000, "Ended requests remembered (outcome for the "
                                      "submitter, idempotent resubmission, `ctl "
                                      "requests`); the oldest are forgotten first.", min=0)
    admin_token_file: str = key("", "File holding the admin bearer token (first line). Admin "
                                "calls need it or an admin certificate (tls); empty = only "
                                "admin certificates.")
    metrics_listen: str = key("", "Prometheus /metrics address host:port; empty = off, port "
                              "0 = any free port.")
    stuck_after_ms: int = key(60_000, "A live request whose stage has not changed this long "
                              "is stuck: the dualpath_scheduler_stuck_requests gauge counts "
                              "them, and `ctl requests` lists them unless it is given "
                              "--stuck-after.", min=1, max=U32_MAX)

    MOVED_KEYS: ClassVar[dict[str, str]] = {
        "tls_cert_file": "tls.cert_file", "tls_key_file": "tls.key_file",
        "tls_client_ca_file": "tls.ca_file (the [tls] section is shared by every process)"}

    def validate(self) -> None:
        check_listen("scheduler", ("metrics_listen",), listen=self.listen,
                     metrics_listen=self.metrics_listen)
        if self.reference_append_tokens > self.reference_context_tokens:
            raise ConfigError(f"config key scheduler.reference_append_tokens = "
                              f"{self.reference_append_tokens}: must be <= "
                              f"reference_context_tokens ({self.reference_context_tokens})")


@dataclass(frozen=True)
class SchedulerClientConfig:
    """How leaders, clients and `dualpath ctl|submit` reach the scheduler."""

    address: str = key("127.0.0.1:50051", "Scheduler address host:port.")
    admin_token_file: str = key("", "File holding the admin bearer token, for `dualpath "
                                "ctl`.")
    timeout_ms: int = key(5000, "Deadline of each call.", min=1, max=U32_MAX)

    MOVED_KEYS: ClassVar[dict[str, str]] = {
        "tls_ca_file": "tls.ca_file", "tls_cert_file": "tls.cert_file",
        "tls_key_file": "tls.key_file (the [tls] section is shared by every process)"}
