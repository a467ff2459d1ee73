"""Network namespaces for a local cluster whose nodes talk over real links: a bridge in
this namespace and one namespace per node behind a veth pair (bench/pipeline.py, the
partition faults of tests/faults and bench/faults.py).

:meth:`Namespaces.cut` takes a node off the network silently (its veth's bridge end
down: frames to it and from it are dropped, no reset, no ICMP), :meth:`Namespaces.heal`
puts it back; connections that were open resume, and whatever the node sent meanwhile
is retransmitted then (the partition the fences must hold against).

Needs root and ``ip`` (iproute2): :func:`available` says why not. Names carry this
process's id; those of dead runs are swept first. One owner; ``close()`` removes
everything (idempotent).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess


def available() -> str:
    """'' when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is missing"
    return ""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def _sweep_stale() -> None:
    """Remove the namespaces and links of earlier runs whose process is gone (a run that
    was SIGKILLed could not remove its own)."""
    def gone(pid: str) -> bool:
        return not os.path.exists(f"/proc/{pid}")

    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                         check=False).stdout
    for m in re.finditer(r"^dpp-(\d+)-\S+", out, re.MULTILINE):
        if gone(m.group(1)):
            subprocess.run(["ip", "netns", "del", m.group(0)], capture_output=True, check=False)
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True,
                         check=False).stdout
    for m in re.finditer(r"^\d+: (dpbr(\d+)|dpv(\d+)h\d+)[@:]", out, re.MULTILINE):
        if gone(m.group(2) or m.group(3)):
            subprocess.run(["ip", "link", "del", m.group(1)], capture_output=True, check=False)


class Namespaces:
    """A bridge here and one network namespace per node behind a veth pair; close()
    removes them (idempotent). Names carry this process's id; those of dead runs are
    swept first."""

    def __init__(self, node_ids: list[str]):
        _sweep_stale()
        k = os.getpid() % 200 + 20
        tag = os.getpid()
        self.bridge, self.bridge_ip = f"dpbr{tag}", f"10.77.{k}.1"
        self.ns = {n: f"dpp-{tag}-{n}" for n in node_ids}
        self.ip = {n: f"10.77.{k}.{10 + i}" for i, n in enumerate(node_ids)}
        self._links: list[str] = []
        self._host_end: dict[str, str] = {}
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.bridge_ip}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, n in enumerate(node_ids):
                ns, host_end, ns_end = self.ns[n], f"dpv{tag}h{i}", f"dpv{tag}n{i}"
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end,
                    "netns", ns)
                self._links.append(host_end)
                self._host_end[n] = host_end
                _ip("link", "set", host_end, "master", self.bridge)
                _ip("link", "set", host_end, "up")
                _ip("-n", ns, "addr", "add", f"{self.ip[n]}/24", "dev", ns_end)
                _ip("-n", ns, "link", "set", ns_end, "up")
        except BaseException:
            self.close()
            raise

    def launcher(self, node: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns[node]]

    def close(self) -> None:
        for link in self._links:
            subprocess.run(["ip", "link", "del", link], capture_output=True, check=False)
        self._links = []
        for ns in self.ns.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)

    def cut(self, node: str) -> None:
        """Take ``node`` off the network, silently (see the module docstring)."""
        _ip("link", "set", self._host_end[node], "down")

    def heal(self, node: str) -> None:
        """Put ``node`` back on the network."""
        _ip("link", "set", self._host_end[node], "up")
