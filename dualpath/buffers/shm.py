"""The node's DRAM buffer handed to a vLLM worker on the same host, as shared memory.

Between a node daemon and its own vLLM worker every KV byte would otherwise cross the
host's network stack twice (the daemon's send, the worker's receive): memory is shared
instead, and a layer of hit KV is one copy by the worker. The buffer is a memfd
(PinnedRegion(shared=True)); only the admitted, authenticated exchange hands it over:

    worker -> daemon  KvConnector.Attach (mutual TLS, the node's own identity)
    daemon -> worker  an abstract Unix socket name and a one-time 128-bit token
    worker -> socket  the token; the daemon checks it (one use, 60 s) and that the peer
                      runs as its own user (SO_PEERCRED), then sends the memfd
                      (SCM_RIGHTS) and closes

Nothing else is ever sent on the socket: without the token a connection learns nothing.
Threads: :class:`BufferOffer` accepts on a thread of its own; ``grant`` and ``close``
from the node's loop. :func:`take_buffer` blocks (the worker's agent thread).
"""

from __future__ import annotations

import hmac
import logging
import mmap
import os
import secrets
import socket
import struct
import threading
import time

from dualpath.errors import DualPathError

log = logging.getLogger("dualpath.node")

TOKEN_BYTES = 16
TOKEN_TTL_S = 60.0


class BufferOffer:
    """Offers one memfd to the holders of tokens it granted."""

    def __init__(self, fd: int, length: int, what: str):
        self.fd, self.length, self.what = fd, length, what
        self.name = f"dualpath-shm-{os.getpid()}-{secrets.token_hex(8)}"
        self._tokens: dict[bytes, float] = {}
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self._sock.bind("\0" + self.name)           # abstract: no file to clean up
        self._sock.listen(16)
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="dualpath-shm", daemon=True)
        self._thread.start()

    def grant(self) -> bytes:
        """A one-time token for one worker (valid :data:`TOKEN_TTL_S`)."""
        token = secrets.token_bytes(TOKEN_BYTES)
        now = time.monotonic()
        with self._lock:
            self._tokens = {t: d for t, d in self._tokens.items() if d > now}
            self._tokens[token] = now + TOKEN_TTL_S
        return token

    def _take(self, token: bytes) -> bool:
        now = time.monotonic()
        with self._lock:
            for t, deadline in list(self._tokens.items()):
                if hmac.compare_digest(t, token):
                    del self._tokens[t]
                    return deadline > now
        return False

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.settimeout(5.0)
                    uid = struct.unpack("3i", conn.getsockopt(
                        socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[1]
                    token = _recv_exactly(conn, TOKEN_BYTES)
                    if uid != os.getuid() or not self._take(token):
                        log.warning("%s: a shared-buffer request without a valid token (uid "
                                    "%d) was refused", self.what, uid)
                        continue
                    socket.send_fds(conn, [struct.pack("<Q", self.length)], [self.fd])
                except (OSError, DualPathError) as e:
                    log.warning("%s: handing over the shared buffer failed: %s", self.what, e)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._thread.join(5)


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise DualPathError("the peer closed the shared-buffer socket early")
        data += chunk
    return data


def take_buffer(name: str, token: bytes, timeout_s: float = 10.0) -> mmap.mmap:
    """The daemon's buffer, mapped shared, for the holder of ``token`` (worker side)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as s:
        s.settimeout(timeout_s)
        s.connect("\0" + name)
        s.sendall(token)
        msg, fds, _, _ = socket.recv_fds(s, 8, 1)
    if len(msg) != 8 or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise DualPathError("the node daemon refused to share its buffer (token refused)")
    (length,) = struct.unpack("<Q", msg)
    try:
        return mmap.mmap(fds[0], length, flags=mmap.MAP_SHARED)
    finally:
        os.close(fds[0])
