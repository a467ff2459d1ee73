"""Config sections ``[scheduler]`` (the daemon) and ``[scheduler_client]`` (leaders, CLI)."""

from __future__ import annotations

from dataclasses import dataclass

from dualpath.config import key
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
    lease_ms: int = key(3000, "A group whose leader is silent this long is marked down and "
                        "its unfinished requests are requeued at the head.", min=10)
    fetch_interval_ms: int = key(20, "Fetch period suggested to leaders at registration.",
                                 min=1)
    max_assignments_per_fetch: int = key(4096, "Upper bound on assignments in one fetch "
                                         "answer.", min=1)
    max_queued_requests: int = key(1_000_000, "Submissions beyond this many waiting requests "
                                   "are refused (RESOURCE_EXHAUSTED).", min=1)
    journal_file: str = key("", "SQLite file (WAL mode) of the durable state: submissions, "
                            "attempts and outcomes survive a restart, and SubmitRequest "
                            "answers only once they are on disk (docs/reliability.md). Empty "
                            "= off: a restart loses every queued and running request.")
    journal_sync: str = key("normal", "normal: a commit survives the scheduler being killed "
                            "at any instant; full: also power loss (an fsync per call that "
                            "changes durable state).", choices=("normal", "full"))
    max_failed_attempts: int = key(5, "A request whose attempts failed this many times (a "
                                   "FAILED report, or the lease of a group holding it lost) "
                                   "ends FAILED, reported to its submitter.", min=1)
    retry_backoff_ms: int = key(100, "Backoff after a request's first failed attempt; it "
                                "doubles with each further failure, jittered to between "
                                "half and all of it.", min=0)
    retry_backoff_max_ms: int = key(5000, "Upper bound of that backoff.", min=0)
    peer_avoid_ms: int = key(3000, "After a failed attempt the request avoids the groups "
                             "blamed for it this long, unless they register again (a new "
                             "lease); then it may go back (a one-node side recovers).",
                             min=0)
    finished_requests_kept: int = key(100_000, "Ended requests remembered (outcome for the "
                                      "submitter, idempotent resubmission, `ctl "
                                      "requests`); the oldest are forgotten first.", min=0)
    tls_cert_file: str = key("", "PEM server certificate; empty = plaintext gRPC (loopback "
                             "and tests only).")
    tls_key_file: str = key("", "PEM private key of tls_cert_file.")
    tls_client_ca_file: str = key("", "PEM CA bundle; when set, clients must present a "
                                  "certificate it signed (mutual TLS).")
    admin_token_file: str = key("", "File holding the admin bearer token (first line). Admin "
                                "calls without it are refused (UNAUTHENTICATED); empty = "
                                "every admin call is refused.")
    metrics_listen: str = key("", "Prometheus /metrics address host:port; empty = off, port "
                              "0 = any free port.")

    def validate(self) -> None:
        check_listen("scheduler", ("metrics_listen",), listen=self.listen,
                     metrics_listen=self.metrics_listen)
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ConfigError("config keys scheduler.tls_cert_file and scheduler.tls_key_file "
                              "must be set together")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ConfigError("config key scheduler.tls_client_ca_file needs "
                              "scheduler.tls_cert_file (mutual TLS runs over TLS)")
        if self.reference_append_tokens > self.reference_context_tokens:
            raise ConfigError(f"config key scheduler.reference_append_tokens = "
                              f"{self.reference_append_tokens}: must be <= "
                              f"reference_context_tokens ({self.reference_context_tokens})")


@dataclass(frozen=True)
class SchedulerClientConfig:
    """How leaders, clients and `dualpath ctl|submit` reach the scheduler."""

    address: str = key("127.0.0.1:50051", "Scheduler address host:port.")
    tls_ca_file: str = key("", "PEM CA bundle that signed the scheduler's certificate; "
                           "empty = plaintext.")
    tls_cert_file: str = key("", "PEM client certificate (when the scheduler requires "
                             "mutual TLS).")
    tls_key_file: str = key("", "PEM private key of tls_cert_file.")
    admin_token_file: str = key("", "File holding the admin bearer token, for `dualpath "
                                "ctl`.")
    timeout_ms: int = key(5000, "Deadline of each call.", min=1)

    def validate(self) -> None:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ConfigError("config keys scheduler_client.tls_cert_file and "
                              "scheduler_client.tls_key_file must be set together")
        if self.tls_cert_file and not self.tls_ca_file:
            raise ConfigError("config key scheduler_client.tls_cert_file needs "
                              "scheduler_client.tls_ca_file (client certificates only "
                              "travel over TLS)")
