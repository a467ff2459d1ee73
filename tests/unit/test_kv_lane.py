"""The KV lane has one source of truth (dualpath/lane.py): the config's defaults and the
shipped fabric configuration (deploy/qos, the multi-node sample) all name the same
low-priority lane."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from dualpath import lane
from dualpath.config_sections import KvLaneConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _opensm() -> dict[str, str]:
    out = {}
    for line in (DEPLOY / "qos" / "opensm-qos.conf").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            k, v = line.split(None, 1)
            out[k] = v.strip()
    return out


def _weights(table: str) -> dict[int, int]:
    return {int(vl): int(w) for vl, w in (e.split(":") for e in table.split(","))}


def test_the_config_defaults_are_the_lane():
    c = KvLaneConfig()
    assert (c.service_level, c.traffic_class) == (lane.KV_SERVICE_LEVEL, lane.KV_TRAFFIC_CLASS)
    assert lane.dscp(c.traffic_class) == lane.KV_DSCP == 24
    assert c.traffic_class & 3 == 0                 # the ECN bits stay the NIC's


def test_opensm_puts_the_lanes_sl_on_a_low_priority_only_vl():
    q = _opensm()
    assert q["qos"] == "TRUE"
    sl2vl = [int(x) for x in q["qos_sl2vl"].split(",")]
    assert len(sl2vl) == 16
    vl = sl2vl[lane.KV_SERVICE_LEVEL]
    assert vl == lane.KV_VIRTUAL_LANE < int(q["qos_max_vls"])
    high, low = _weights(q["qos_vlarb_high"]), _weights(q["qos_vlarb_low"])
    assert high[vl] == 0, "the KV VL must have no share of the high-priority table"
    assert 0 < low[vl] == min(low.values()), "the KV VL gets the smallest low share"
    # every other VL an SL maps to is a high-priority one (inference traffic)
    assert all(high[v] > 0 for sl, v in enumerate(sl2vl) if v != vl)


def test_roce_script_queues_the_lanes_dscp_without_pfc():
    text = (DEPLOY / "qos" / "roce-dscp.sh").read_text()
    defaults = dict(re.findall(r"\b(dscp|prio)=(\d+)", text.split("while", 1)[0]))
    assert int(defaults["dscp"]) == lane.KV_DSCP
    assert int(defaults["prio"]) == lane.KV_NIC_PRIORITY
    pfc = re.search(r"--pfc ([0-9,]+)", text).group(1).split(",")
    assert pfc[lane.KV_NIC_PRIORITY] == "0", "KV must not sit in a lossless (PFC) class"
    tcbw = [int(x) for x in re.search(r"--tcbw ([0-9,]+)", text).group(1).split(",")]
    assert sum(tcbw) == 100 and 0 < tcbw[lane.KV_NIC_PRIORITY] < max(tcbw)


def test_the_multinode_sample_uses_the_lane():
    cfg = tomllib.loads((DEPLOY / "cluster-multinode.toml").read_text())
    kv = cfg.get("kv_lane", {})
    assert kv.get("service_level", lane.KV_SERVICE_LEVEL) == lane.KV_SERVICE_LEVEL
    assert kv.get("traffic_class", lane.KV_TRAFFIC_CLASS) == lane.KV_TRAFFIC_CLASS


def test_the_start_up_line_says_whether_it_is_the_shipped_lane():
    assert "shipped low-priority" in lane.describe(2, 96)
    assert lane.describe(0, 0) == "SL 0 / TC 0 (DSCP 0)"
