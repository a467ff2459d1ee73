"""An asyncio client of the scheduler, for group leaders, clients and `dualpath ctl`.

One :class:`SchedulerClient` owns one grpc.aio channel; use it from the event loop that
created it (``async with SchedulerClient(...) as c``). Methods return the protobuf
replies; gRPC errors propagate as ``grpc.aio.AioRpcError``; commands turn them into the
typed errors the CLI maps to exit codes with :func:`rpc_error`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Self

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dualpath import rpc, tls
from dualpath.errors import DualPathError, RemoteUnavailable, UsageError
from dualpath.scheduler.config import SchedulerClientConfig
from dualpath.v1 import admin_pb2, admin_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

# Codes that mean "could not reach or was refused by the remote side" (CLI exit 3).
UNREACHABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                         grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})


class SchedulerUnavailable(RemoteUnavailable):
    """The scheduler could not be reached, or refused the caller."""


def is_unreachable(e: BaseException) -> bool:
    return isinstance(e, grpc.aio.AioRpcError) and e.code() in UNREACHABLE


def rpc_error(e: grpc.aio.AioRpcError, address: str) -> DualPathError:
    """A failed scheduler call as the typed error the CLI maps to its exit code:
    SchedulerUnavailable (3), UsageError for a refused argument (2), else 1."""
    msg = f"scheduler {address}: {e.code().name}: {e.details()}"
    if is_unreachable(e):
        return SchedulerUnavailable(msg)
    if e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE):
        return UsageError(msg)
    return DualPathError(msg)


class SchedulerClient:
    """Scheduler, Admin and health stubs over one channel (with keepalives and a short
    reconnect backoff, :data:`dualpath.rpc.CHANNEL_OPTIONS`, unless ``options`` set
    them)."""

    def __init__(self, address: str, *, credentials: grpc.ChannelCredentials | None = None,
                 admin_token: str | None = None, timeout_s: float = 5.0,
                 options: Iterable[tuple[str, object]] = (),
                 channel: grpc.aio.Channel | None = None):
        opts = list(options)
        given = {k for k, _ in opts}
        opts += [kv for kv in rpc.CHANNEL_OPTIONS if kv[0] not in given]
        if channel is not None:            # made by from_config (checks who answers)
            self.channel = channel
        else:
            self.channel = (grpc.aio.secure_channel(address, credentials, opts)
                            if credentials is not None
                            else grpc.aio.insecure_channel(address, opts))
        self.address = address
        self.timeout_s = timeout_s
        self._auth = tls.bearer_metadata(admin_token)
        self.scheduler = scheduler_pb2_grpc.SchedulerStub(self.channel)
        self.admin = admin_pb2_grpc.AdminStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    @classmethod
    def from_config(cls, cfg: SchedulerClientConfig, tls_config: tls.TlsConfig,
                    address: str | None = None,
                    admin_token: str | None = None) -> SchedulerClient:
        """A client per ``[scheduler_client]`` over ``[tls]`` (mutual TLS with our
        certificate, the server checked to be ``tls.scheduler_identity``, or explicit
        plaintext); ConfigError when neither is configured."""
        if admin_token is None and cfg.admin_token_file:
            admin_token = tls.read_token(cfg.admin_token_file, "scheduler_client.admin_token_file")
        address = address or cfg.address
        ch = tls.channel(address, tls_config, rpc.CHANNEL_OPTIONS,
                         expect=tls_config.scheduler_identity, explain=True)
        return cls(address, admin_token=admin_token, timeout_s=cfg.timeout_ms / 1000.0,
                   channel=ch)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------ leaders

    async def register_group(self, group_id: str, role: int,
                             engines: Iterable[scheduler_pb2.EngineInfo],
                             storage_read_bytes_per_s: int = 0,
                             running: Iterable[scheduler_pb2.RunningRequest] = ()
                             ) -> scheduler_pb2.RegisterGroupResponse:
        return await self.scheduler.RegisterGroup(scheduler_pb2.RegisterGroupRequest(
            group_id=group_id, role=role, engines=list(engines),
            storage_read_bytes_per_s=storage_read_bytes_per_s, running=list(running)),
            timeout=self.timeout_s)

    async def release_group(self, group_id: str, lease_id: int
                            ) -> scheduler_pb2.ReleaseGroupResponse:
        return await self.scheduler.ReleaseGroup(scheduler_pb2.ReleaseGroupRequest(
            group_id=group_id, lease_id=lease_id), timeout=self.timeout_s)

    async def fetch(self, group_id: str, lease_id: int,
                    engines: Iterable[scheduler_pb2.EngineStatus],
                    max_assignments: int = 0,
                    completions: Iterable[scheduler_pb2.Completion] = (),
                    wait_ms: int = 0) -> scheduler_pb2.FetchResponse:
        return await self.scheduler.Fetch(scheduler_pb2.FetchRequest(
            group_id=group_id, lease_id=lease_id, engines=list(engines),
            max_assignments=max_assignments, completions=list(completions),
            wait_ms=wait_ms), timeout=self.timeout_s + wait_ms / 1000)

    async def report(self, group_id: str, lease_id: int,
                     completions: Iterable[scheduler_pb2.Completion]
                     ) -> scheduler_pb2.ReportCompletionResponse:
        return await self.scheduler.ReportCompletion(scheduler_pb2.ReportCompletionRequest(
            group_id=group_id, lease_id=lease_id, completions=list(completions)),
            timeout=self.timeout_s)

    async def submit(self, requests: Iterable[scheduler_pb2.RequestSpec]
                     ) -> scheduler_pb2.SubmitRequestResponse:
        return await self.scheduler.SubmitRequest(
            scheduler_pb2.SubmitRequestRequest(requests=list(requests)), timeout=self.timeout_s)

    async def get_results(self, request_ids: Iterable[str], *,
                          acknowledged: Iterable[str] = (), wait_ms: int = 0
                          ) -> scheduler_pb2.GetResultsResponse:
        return await self.scheduler.GetResults(scheduler_pb2.GetResultsRequest(
            request_ids=list(request_ids), acknowledged_request_ids=list(acknowledged),
            wait_ms=wait_ms), timeout=self.timeout_s + wait_ms / 1000.0)

    # ------------------------------------------------------------ operators

    async def list_engines(self) -> admin_pb2.ListEnginesResponse:
        return await self.admin.ListEngines(admin_pb2.ListEnginesRequest(),
                                            timeout=self.timeout_s, metadata=self._auth)

    async def list_groups(self) -> admin_pb2.ListGroupsResponse:
        return await self.admin.ListGroups(admin_pb2.ListGroupsRequest(),
                                           timeout=self.timeout_s, metadata=self._auth)

    async def stats(self) -> admin_pb2.StatsResponse:
        return await self.admin.Stats(admin_pb2.StatsRequest(), timeout=self.timeout_s,
                                      metadata=self._auth)

    async def drain(self, engine_id: str, undo: bool = False) -> admin_pb2.DrainResponse:
        return await self.admin.Drain(admin_pb2.DrainRequest(engine_id=engine_id, undo=undo),
                                      timeout=self.timeout_s, metadata=self._auth)

    async def set_params(self, **changes: int | bool) -> admin_pb2.SetParamsResponse:
        return await self.admin.SetParams(admin_pb2.SetParamsRequest(**changes),
                                          timeout=self.timeout_s, metadata=self._auth)

    async def list_requests(self, *, stuck_after_ms: int = 0, all: bool = False,
                            limit: int = 0) -> admin_pb2.ListRequestsResponse:
        return await self.admin.ListRequests(admin_pb2.ListRequestsRequest(
            stuck_after_ms=stuck_after_ms, all=all, limit=limit), timeout=self.timeout_s,
            metadata=self._auth)

    async def cancel(self, request_ids: Iterable[str]) -> admin_pb2.CancelResponse:
        return await self.admin.Cancel(admin_pb2.CancelRequest(request_ids=list(request_ids)),
                                       timeout=self.timeout_s, metadata=self._auth)

    async def health(self, service: str = "") -> int:
        """The health status enum (1 = SERVING)."""
        r = await self.health_stub.Check(health_pb2.HealthCheckRequest(service=service),
                                         timeout=self.timeout_s)
        return r.status
