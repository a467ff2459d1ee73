"""A P/D replay on a real networked filesystem, across hosts: each node of a 1P2D cluster
in a network namespace of its own, with its own GlusterFS FUSE client mounting the same
volume over its veth (glusterd and the brick on this host, reached at the bridge's
address), the store bounded so its one evictor (whichever node takes the lock over
GlusterFS's POSIX locks) evicts while three replays run. Every prompt byte a DE receives
is checked against the generator; the store never holds more than its bound.

Run by ``make test-shared-fs`` (tools/sharedfs/gluster.sh sets the volume up and names it
in DUALPATH_SHARED_FS_VOLUME, its host mount in DUALPATH_SHARED_FS)."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from dualpath.cluster.local import LocalCluster
from dualpath.cluster.netns import Namespaces, available
from tests.integration.test_e2e_bounded import CAP_BYTES, replays_verified, usage

NODES = ["p0", "d0", "d1"]
# Mount the volume in the node's own mount namespace, then become the node.
MOUNT_THEN_RUN = 'm=$0; v=$1; shift; mount -t glusterfs "$v" "$m" && exec "$@"'


def _env(name: str) -> str:
    v = os.environ.get(name, "")
    assert v, f"{name} is not set: run this tier with `make test-shared-fs`"
    return v


@pytest.fixture(scope="module")
def gluster_cluster(tmp_path_factory):
    volume, host_mount = _env("DUALPATH_SHARED_FS_VOLUME"), Path(_env("DUALPATH_SHARED_FS"))
    assert not available(), available()
    server = volume.split(":", 1)[0]
    sub = f"kv-{uuid.uuid4().hex[:8]}"
    work = tmp_path_factory.mktemp("gluster-pd")
    nets = Namespaces(NODES)
    mounts = {n: work / f"mnt-{n}" for n in NODES}
    try:
        launchers, node_settings = {}, {}
        for n in NODES:
            etc = Path("/etc/netns") / nets.ns[n]      # `ip netns exec` binds it over /etc/hosts
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n{nets.bridge_ip} {server}\n")
            mounts[n].mkdir()
            launchers[n] = nets.launcher(n) + ["sh", "-c", MOUNT_THEN_RUN, str(mounts[n]),
                                               volume]
            node_settings[n] = {"engine": {"control_listen": f"{nets.ip[n]}:0",
                                           "metrics_listen": f"{nets.ip[n]}:0"},
                                "transfer": {"tcp_listen": nets.ip[n]},
                                "storage": {"dir": str(mounts[n] / sub)}}
        c = LocalCluster(1, 2, work_dir=str(work), host=nets.bridge_ip,
                         settings={"transport": {"kind": "tcp"},
                                   "storage": {"capacity_gib": CAP_BYTES / 2**30,
                                               "upkeep_interval_s": 0.1,
                                               "low_watermark": 0.6}},
                         node_settings=node_settings, tls_ips=tuple(nets.ip.values()),
                         node_launchers=launchers)
        c.start()
        try:
            yield c, nets, host_mount / sub, mounts
        finally:
            c.stop()
    finally:
        for n in NODES:        # each node's FUSE client outlives the node: end it
            subprocess.run(["pkill", "-f", f"glusterfs.*{mounts[n]}"], check=False)
            shutil.rmtree(Path("/etc/netns") / nets.ns[n], ignore_errors=True)
        nets.close()
        shutil.rmtree(host_mount / sub, ignore_errors=True)


def test_pd_replays_on_glusterfs_across_namespaces_evict_and_verify(gluster_cluster):
    cluster, nets, kv, mounts = gluster_cluster
    # Each node has a GlusterFS client of its own (its mount is not the host's).
    for n in NODES:
        out = subprocess.run(["pgrep", "-af", f"glusterfs.*{mounts[n]}"], check=False,
                             capture_output=True, text=True).stdout
        assert str(mounts[n]) in out, f"{n}: no GlusterFS client of its own"
    runs, peak = replays_verified(cluster, kv, timeout_s=180,
                                  sink_listen=f"{nets.bridge_ip}:0")
    m = {n: cluster.node_metrics(n) for n in NODES}
    assert peak <= CAP_BYTES, (peak, CAP_BYTES)
    assert sum(r.hit_bytes for r in runs) > 0
    evictors = [n for n in NODES if m[n]["dualpath_node_store_evictor"] == 1]
    assert len(evictors) == 1, {n: m[n]["dualpath_node_store_evictor"] for n in NODES}
    assert m[evictors[0]]["dualpath_node_store_evictions_total"] > 0
    # The blocks were written by the nodes' clients and are the volume's: the host's
    # own mount sees them.
    assert usage(kv) > 0
