"""Which RDMA NIC each GPU's KV goes through: the nearest one on the PCIe tree.

The paper gives each GPU a compute NIC of its own (§4.2): a WRITE into a GPU's KV that
crosses the CPU's interconnect, or shares a NIC with every other GPU, loses the
bandwidth the design counts on. sysfs says where each device hangs: a PCI device's
resolved path lists the bridges above it (``/sys/devices/pci0000:00/0000:00:01.0/
0000:01:00.0/...``) and ``numa_node`` its socket. Closeness, as ``nvidia-smi topo``
names it: behind the same PCIe switch (PIX/PXB: the longer the shared bridge path, the
closer), under the same root complex (PHB), on the same NUMA node (NODE), else across
the socket link (SYS).

:func:`pair` is the pure core: each GPU (in PCI bus order, the order CUDA uses with
``CUDA_DEVICE_ORDER=PCI_BUS_ID``) takes the closest NIC, ties going to the NIC fewer
GPUs took already, then by name; an operator's pairs (``[transport] gpu_nics``) win.
A process finds its GPU by PCI address (the CUDA driver's, dualpath/gpu.py), so
CUDA_VISIBLE_DEVICES and CUDA's own device order do not matter.
:func:`scan` is its sysfs shell (``root`` for tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dualpath.errors import UsageError

NVIDIA = "0x10de"


@dataclass(frozen=True)
class PciDevice:
    name: str                   # "GPU 0" / the RDMA device name
    bdf: str                    # its PCI address, e.g. 0000:17:00.0
    bridges: tuple[str, ...]    # the PCI path above it, root complex first
    numa: int | None


def closeness(a: PciDevice, b: PciDevice) -> tuple[int, int, str]:
    """(rank, shared bridges, nvidia-smi's word): a higher rank is closer."""
    shared = 0
    for x, y in zip(a.bridges, b.bridges):
        if x != y:
            break
        shared += 1
    if shared >= 2:            # below the root port: one PCIe switch (or a chain of them)
        return 3, shared, "PIX" if shared == min(len(a.bridges), len(b.bridges)) else "PXB"
    if shared == 1:            # the same root complex
        return 2, shared, "PHB"
    if a.numa is not None and a.numa == b.numa:
        return 1, 0, "NODE"
    return 0, 0, "SYS"


def parse_pairs(text: str) -> dict[int, str]:
    """``[transport] gpu_nics``: ``"0=mlx5_0,1=mlx5_1"`` (GPU index = NIC name)."""
    out: dict[int, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        gpu, sep, nic = part.partition("=")
        if not sep or not gpu.strip().isdigit() or not nic.strip():
            raise UsageError(f"transport.gpu_nics: {part!r} is not GPU=NIC (e.g. 0=mlx5_0)")
        out[int(gpu)] = nic.strip()
    return out


def pair(gpus: list[PciDevice], nics: list[PciDevice],
         override: dict[int, str] | None = None) -> dict[int, tuple[str, str]]:
    """GPU index (PCI bus order) -> (NIC name, how close: nvidia-smi's word or "set")."""
    override = override or {}
    names = {n.name for n in nics}
    out: dict[int, tuple[str, str]] = {}
    load = {n.name: 0 for n in nics}
    for i, g in enumerate(gpus):
        if i in override:
            nic = override[i]
            if nic not in names:
                raise UsageError(f"transport.gpu_nics pairs GPU {i} with {nic}, which is not "
                                 f"an RDMA device here ({', '.join(sorted(names)) or 'none'})")
            out[i] = (nic, "set")
            load[nic] += 1
            continue
        if not nics:
            continue
        best = max(nics, key=lambda n: (closeness(g, n)[:2], -load[n.name],
                                        [-ord(c) for c in n.name]))
        out[i] = (best.name, closeness(g, best)[2])
        load[best.name] += 1
    return out


def _pci(path: Path, name: str) -> PciDevice:
    real = path.resolve()
    parts = [p for p in real.parts if ":" in p and "." in p]      # the BDFs on the way
    try:
        numa = int((real / "numa_node").read_text())
    except (OSError, ValueError):
        numa = None
    root = next((p for p in real.parts if p.startswith("pci")), "")
    return PciDevice(name, parts[-1] if parts else real.name, (root, *parts[:-1]),
                     numa if numa is not None and numa >= 0 else None)


def scan(root: str = "/") -> tuple[list[PciDevice], list[PciDevice]]:
    """(NVIDIA GPUs in PCI bus order, RDMA devices by name) from sysfs under ``root``."""
    base = Path(root)
    gpus = []
    for dev in sorted((base / "sys/bus/pci/devices").glob("*")):
        try:
            if (dev / "vendor").read_text().strip() != NVIDIA or \
                    not (dev / "class").read_text().startswith("0x03"):
                continue
        except OSError:
            continue
        gpus.append(_pci(dev, f"GPU {len(gpus)}"))
    nics = [_pci(d / "device", d.name)
            for d in sorted((base / "sys/class/infiniband").glob("*"))
            if (d / "device").exists()]
    return gpus, nics


def nic_for(bdf: str, override: str = "", root: str = "/") -> tuple[str, str]:
    """The NIC the KV of the GPU at PCI address ``bdf`` goes through and why ("" when
    there is none to pick). ``override``'s GPU indices count in PCI bus order (as
    nvidia-smi numbers them), whatever CUDA_VISIBLE_DEVICES does to a process's."""
    gpus, nics = scan(root)
    pairs = pair(gpus, nics, parse_pairs(override))
    index = next((i for i, g in enumerate(gpus) if g.bdf == bdf.lower()), None)
    return pairs.get(index, ("", "")) if index is not None else ("", "")
