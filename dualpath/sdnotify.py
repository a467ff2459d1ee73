"""systemd's service notifications (sd_notify(3)), spoken without libsystemd.

A unit of ``Type=notify`` learns from its daemon when it is really up: ``READY=1`` once
its own servers serve, ``STATUS=`` lines that ``systemctl status`` shows (registration,
lease), ``STOPPING=1`` at shutdown, and with ``WatchdogSec=`` a ``WATCHDOG=1`` ping at
half that period, sent from the daemon's event loop, so a loop that stops turning stops
the pings and systemd restarts the daemon. Outside systemd (no ``NOTIFY_SOCKET``) every
call is a no-op. Messages are datagrams to that socket (a path, or ``@name`` for an
abstract one); a message that cannot be sent is logged once, never fatal.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket

log = logging.getLogger("dualpath.sdnotify")


class Notifier:
    def __init__(self, env: dict[str, str] | None = None):
        env = os.environ if env is None else env
        addr = env.get("NOTIFY_SOCKET", "")
        self.address = "\0" + addr[1:] if addr.startswith("@") else addr
        self.watchdog_s: float | None = None
        usec, pid = env.get("WATCHDOG_USEC", ""), env.get("WATCHDOG_PID", "")
        if usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            self.watchdog_s = int(usec) / 2e6
        self._sock: socket.socket | None = None
        self._warned = False

    @property
    def enabled(self) -> bool:
        return bool(self.address)

    def send(self, **fields: str) -> bool:
        """One notification (``READY="1"``, ``STATUS="..."``); False when not sent."""
        if not self.address:
            return False
        msg = "\n".join(f"{k}={v}" for k, v in fields.items()).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(msg, self.address)
            return True
        except OSError as e:
            if not self._warned:
                self._warned = True
                log.warning("systemd notification to %s failed: %s (further failures are "
                            "not logged)", self.address.replace("\0", "@"), e.strerror)
            return False

    def ready(self, status: str) -> None:
        self.send(READY="1", STATUS=status)

    def status(self, text: str) -> None:
        self.send(STATUS=text)

    def stopping(self, status: str) -> None:
        self.send(STOPPING="1", STATUS=status)

    async def watchdog(self) -> None:
        """Ping every half watchdog period until cancelled (a no-op task without one)."""
        if self.watchdog_s is None or not self.address:
            return
        while True:
            self.send(WATCHDOG="1")
            await asyncio.sleep(self.watchdog_s)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
