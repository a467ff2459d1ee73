"""GPU -> RDMA NIC pairing from the PCIe tree (issue 39 item 5), over a fake sysfs of a
two-socket 8-GPU node: each pair of GPUs shares a PCIe switch with one NIC, socket 1's
GPUs and NICs sit on NUMA node 1, and one GPU has no NIC under its switch."""

from __future__ import annotations

import os

import pytest

from dualpath import topology
from dualpath.config import load
from dualpath.errors import UsageError


def _device(root, path: str, **files) -> str:
    d = root / "sys/devices" / path
    d.mkdir(parents=True)
    for k, v in files.items():
        (d / k).write_text(v)
    return str(d)


def _node(root, switches):
    """``switches``: per PCIe switch (socket, GPUs under it, NICs under it)."""
    (root / "sys/bus/pci/devices").mkdir(parents=True)
    (root / "sys/class/infiniband").mkdir(parents=True)
    bus = 0x10
    for i, (socket, gpus, nics) in enumerate(switches):
        base = f"pci0000:{socket:02x}/0000:{socket:02x}:0{i % 8}.0/0000:{bus:02x}:00.0"
        for j in range(gpus + len(nics)):
            bdf = f"0000:{bus + 1:02x}:{j:02x}.0"
            is_gpu = j < gpus
            d = _device(root, f"{base}/{bdf}", vendor="0x10de\n" if is_gpu else "0x15b3\n",
                        numa_node=f"{socket}\n",
                        **{"class": "0x030200\n" if is_gpu else "0x020700\n"})
            os.symlink(d, root / "sys/bus/pci/devices" / bdf)
            if not is_gpu:
                ib = root / "sys/class/infiniband" / nics[j - gpus]
                ib.mkdir()
                os.symlink(d, ib / "device")
        bus += 0x10


def test_each_gpu_takes_the_nic_under_its_own_switch(tmp_path):
    _node(tmp_path, [(0, 2, ["mlx5_0"]), (0, 2, ["mlx5_1"]),
                     (1, 2, ["mlx5_2"]), (1, 2, ["mlx5_3"])])
    gpus, nics = topology.scan(str(tmp_path))
    assert [g.name for g in gpus] == [f"GPU {i}" for i in range(8)]
    assert [n.name for n in nics] == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]
    pairs = topology.pair(gpus, nics)
    assert {i: nic for i, (nic, _) in pairs.items()} == {
        0: "mlx5_0", 1: "mlx5_0", 2: "mlx5_1", 3: "mlx5_1",
        4: "mlx5_2", 5: "mlx5_2", 6: "mlx5_3", 7: "mlx5_3"}
    assert {how for _, how in pairs.values()} <= {"PIX", "PXB"}


def test_a_gpu_without_a_nic_under_its_switch_stays_on_its_socket_and_balances(tmp_path):
    # Socket 0: a switch with 2 GPUs and no NIC, a switch with one NIC; socket 1: a NIC.
    _node(tmp_path, [(0, 2, []), (0, 0, ["mlx5_0"]), (1, 0, ["mlx5_1"])])
    gpus, nics = topology.scan(str(tmp_path))
    pairs = topology.pair(gpus, nics)
    assert pairs == {0: ("mlx5_0", "PHB"), 1: ("mlx5_0", "PHB")}   # never across sockets


def test_ties_go_to_the_nic_fewer_gpus_took(tmp_path):
    _node(tmp_path, [(0, 4, ["mlx5_0", "mlx5_1"])])
    pairs = topology.pair(*topology.scan(str(tmp_path)))
    assert [nic for nic, _ in pairs.values()] == ["mlx5_0", "mlx5_1", "mlx5_0", "mlx5_1"]


def test_the_operators_pairs_win_and_are_checked(tmp_path):
    _node(tmp_path, [(0, 2, ["mlx5_0"]), (1, 0, ["mlx5_1"])])
    gpus, nics = topology.scan(str(tmp_path))
    pairs = topology.pair(gpus, nics, topology.parse_pairs("1=mlx5_1"))
    assert pairs == {0: ("mlx5_0", "PIX"), 1: ("mlx5_1", "set")}
    with pytest.raises(UsageError, match="mlx5_9, which is not an RDMA device"):
        topology.pair(gpus, nics, {0: "mlx5_9"})
    # A process finds its GPU by PCI address (its CUDA index may be anything).
    assert topology.nic_for(gpus[1].bdf.upper(), "1=mlx5_1", str(tmp_path)) == \
        ("mlx5_1", "set")
    assert topology.nic_for(gpus[0].bdf, "", str(tmp_path)) == ("mlx5_0", "PIX")
    assert topology.nic_for("0000:99:00.0", "", str(tmp_path)) == ("", "")


@pytest.mark.parametrize("bad", ["0", "x=mlx5_0", "0=", "0:mlx5_0"])
def test_a_malformed_pair_is_refused_at_config_load(tmp_path, bad):
    with pytest.raises(UsageError, match="gpu_nics"):
        load(None, {"transport.gpu_nics": bad})
