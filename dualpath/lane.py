"""The KV lane: where KV transfers travel on a fabric they share with inference traffic
(paper appendix A.1). The one source of truth for its mapping.

DualPath only marks its QPs; the fabric enforces the priority. Every default that names
the lane comes from here: ``[kv_lane]`` (dualpath/config_sections.py), the verbs
provider's, and the shipped fabric configuration, which tests/unit/test_kv_lane.py holds
to these numbers:

    deploy/qos/opensm-qos.conf   SL KV_SERVICE_LEVEL -> VL KV_VIRTUAL_LANE, a VL with no
                                 share of the high-priority arbitration table and the
                                 smallest share of the low-priority one
    deploy/qos/roce-dscp.sh      DSCP KV_DSCP -> NIC priority KV_NIC_PRIORITY (a small ETS
                                 share, no PFC: the lossless class stays inference's)
    deploy/cluster-multinode.toml
                                 the same SL / traffic class
"""

from __future__ import annotations

KV_SERVICE_LEVEL = 2          # InfiniBand SL of every KV QP
KV_VIRTUAL_LANE = 2           # the VL opensm-qos.conf maps that SL to (low priority only)
KV_TRAFFIC_CLASS = 96         # RoCE v2 GRH traffic class (ECN bits 0)
KV_DSCP = KV_TRAFFIC_CLASS >> 2   # 24: what the IPv4 header carries
KV_NIC_PRIORITY = 2           # the NIC priority roce-dscp.sh maps KV_DSCP to


def dscp(traffic_class: int) -> int:
    """The DSCP a GRH traffic class puts on the wire (its upper six bits)."""
    return traffic_class >> 2


def describe(service_level: int, traffic_class: int) -> str:
    """The lane as daemons log it, and whether it is the shipped low-priority one."""
    shipped = (service_level, traffic_class) == (KV_SERVICE_LEVEL, KV_TRAFFIC_CLASS)
    return (f"SL {service_level} / TC {traffic_class} (DSCP {dscp(traffic_class)}"
            f"{', the shipped low-priority KV lane' if shipped else ''})")
