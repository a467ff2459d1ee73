"""Attackers from a network namespace of the test's own.

:class:`NetnsPair` makes two namespaces joined by a veth pair: the *victim* namespace
(10.203.<k>.1/30) and the *attacker* namespace (10.203.<k>.2/30). Both addresses live only
inside those namespaces (nothing is added to the host's own network), and nothing else
is reachable from them. A victim runs there as a subprocess (:meth:`popen`) or, for code
the test must inspect in-process (a TCP engine's memory), on a thread that joined the
victim namespace (:meth:`call_in`): sockets belong to the namespace of the thread that
made them. Needs root and ``ip`` (iproute2); tests skip with the reason otherwise.

Threads: one owner; :meth:`call_in` runs functions on a private thread per namespace.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from dualpath.cluster.netns import available

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


class NetnsPair:
    def __init__(self, tag: str):
        k = os.getpid() % 250 + 1
        self.victim, self.attacker = f"dpv-{tag}-{os.getpid()}", f"dpa-{tag}-{os.getpid()}"
        self.victim_ip, self.attacker_ip = f"10.203.{k}.1", f"10.203.{k}.2"
        self._pools: dict[str, ThreadPoolExecutor] = {}
        va, vb = f"dv{os.getpid() % 100000}", f"da{os.getpid() % 100000}"
        try:
            for ns in (self.victim, self.attacker):
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            _ip("link", "add", va, "netns", self.victim, "type", "veth", "peer", "name", vb,
                "netns", self.attacker)
            for ns, dev, addr in ((self.victim, va, self.victim_ip),
                                  (self.attacker, vb, self.attacker_ip)):
                _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
        except BaseException:
            self.close()
            raise

    def argv(self, ns: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", ns, *argv]

    def popen(self, ns: str, argv: list[str], **kw) -> subprocess.Popen:
        return subprocess.Popen(self.argv(ns, argv), **kw)

    def python(self, ns: str, code: str, *args: str, timeout: float = 120) -> str:
        """Run ``code`` with this interpreter inside ``ns``; its stdout (fails loudly)."""
        r = subprocess.run(self.argv(ns, [sys.executable, "-c", code, *args]),
                           capture_output=True, text=True, timeout=timeout, check=False)
        assert r.returncode == 0, f"in {ns}: exit {r.returncode}\n{r.stderr}"
        return r.stdout

    def call_in(self, ns: str, fn, *args):
        """``fn(*args)`` on a thread that joined ``ns`` (its sockets live there)."""
        pool = self._pools.get(ns)
        if pool is None:
            pool = ThreadPoolExecutor(1, initializer=_join, initargs=(ns,))
            self._pools[ns] = pool
        return pool.submit(fn, *args).result()

    def close(self) -> None:
        for pool in self._pools.values():
            pool.shutdown(wait=True)
        for ns in (self.victim, self.attacker):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


def _join(ns: str) -> None:
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {ns}")
    finally:
        os.close(fd)


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if r.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


def netns_fixture(tag: str):
    """A module fixture body: yields a NetnsPair (skips when namespaces are unavailable)."""
    why = available()
    if why:
        pytest.skip(why)
    pair = NetnsPair(tag)
    try:
        yield pair
    finally:
        pair.close()
