"""Config sections of the data plane core (transport choice and the KV lane)."""

from __future__ import annotations

from dataclasses import dataclass

from dualpath import lane
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
