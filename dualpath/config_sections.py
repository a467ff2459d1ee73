"""Config sections of the data plane core (transport choice and the KV lane)."""

from __future__ import annotations

from dataclasses import dataclass

from dualpath import lane, rpc
from dualpath.config import key


@dataclass(frozen=True)
class TransportConfig:
    """Which transport carries KV bytes and on which RDMA device."""

    kind: str = key("auto", "'verbs' fails loudly when no RDMA device is usable; 'tcp' "
                    "uses the TCP provider; 'auto' picks verbs when a device has an ACTIVE "
                    "port, else tcp, and logs which.", choices=("auto", "verbs", "tcp"))
    device: str = key("", "RDMA device name (e.g. mlx5_0, rxe0); empty = first device "
                      "with an ACTIVE port.")
    port: int = key(1, "RDMA port number.", min=1, max=255)
    gid_index: int = key(-1, "GID index; -1 = pick the RoCE v2 IPv4-mapped GID "
                         "automatically (or the first GID on InfiniBand).", min=-1, max=255)
    gpu_nics: str = key("", "Which RDMA device a vLLM worker whose KV is on GPU i (PCI bus "
                        "order, as nvidia-smi numbers them) uses: '0=mlx5_0,1=mlx5_1'; "
                        "empty = the nearest to the GPU on the PCIe "
                        "tree (dualpath/topology.py; `dualpath doctor` shows the pairs). "
                        "Wins over device for GPU workers.")

    def __post_init__(self) -> None:
        from dualpath.topology import parse_pairs
        parse_pairs(self.gpu_nics)          # a malformed pair is refused at load


@dataclass(frozen=True)
class KvLaneConfig:
    """The low-priority lane KV transfers travel on (paper A.1)."""

    service_level: int = key(lane.KV_SERVICE_LEVEL, "InfiniBand service level (SL) of KV "
                             "QPs; the default is the SL deploy/qos/opensm-qos.conf maps to "
                             "its low-priority VL.", min=0, max=15)
    traffic_class: int = key(lane.KV_TRAFFIC_CLASS, "RoCE GRH traffic class of KV QPs; DSCP "
                             "on the wire = traffic_class >> 2; the default's DSCP (24) is "
                             "the one deploy/qos/roce-dscp.sh queues at low priority.",
                             min=0, max=255)


@dataclass(frozen=True)
class GrpcConfig:
    """Bounds every gRPC port of the process keeps (scheduler, node, worker agent, sinks):
    what one connection may hold before it proves itself, and how many it may hold."""

    max_connections: int = key(
        rpc.MAX_CONNECTIONS, "Connections one gRPC port holds at once, those still in "
        "their TLS handshake included; past it a new connection is closed at once (a "
        "flood of idle connections exhausted a node's descriptors).", min=16, max=65536)
    handshake_timeout_s: float = key(
        rpc.HANDSHAKE_TIMEOUT_S, "A connection that has not finished its TLS and HTTP/2 "
        "handshake by then is closed (gRPC's own default is 120 s).", min=1.0, max=120.0)
    idle_timeout_s: float = key(
        rpc.IDLE_TIMEOUT_S, "A connection that carried no call for this long is closed (a "
        "client reconnects when it calls again; keepalive pings do not count as calls).",
        min=10.0, max=86400.0)
