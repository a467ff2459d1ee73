"""The front end's HTTP connections, bounded before a request is parsed (issue 38: 1,000
slow connections held the front end for 150 s; aiohttp bounds neither how many
connections it holds nor how long a request head may take).

- ``max_connections``: a connection past it is closed as it is made;
- ``header_timeout_s``: a connection that has not sent a whole request head that long
  after it opened (or after its last answer, on a kept-alive connection) is closed;
- the body's own deadline (``body_timeout_s``) is the handler's (server.py: 408).

:func:`bound` turns an aiohttp :class:`~aiohttp.web_server.Server` (an AppRunner's,
after ``setup()``) into one whose connections are these. Threads: the loop only.
"""

from __future__ import annotations

import asyncio

from aiohttp import web_protocol, web_server


class _Bounded(web_server.Server):
    max_connections = 1024
    header_timeout_s = 10.0

    def __call__(self) -> web_protocol.RequestHandler:
        return _Connection(self, loop=self._loop, **self._kwargs)


class _Connection(web_protocol.RequestHandler):
    """One HTTP connection: closed at once past the cap, or when no request head came
    within the deadline."""

    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        server = self._manager
        super().connection_made(transport)
        if len(server.connections) > server.max_connections:
            self.force_close()
            return
        self.wait_for_head(server.header_timeout_s)

    def wait_for_head(self, timeout_s: float) -> None:
        """Close the connection unless a request head arrives within ``timeout_s``."""
        self.head_came()
        self._deadline = asyncio.get_running_loop().call_later(timeout_s, self._too_slow)

    def head_came(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        self.force_close()

    def connection_lost(self, exc: BaseException | None) -> None:
        self.head_came()
        super().connection_lost(exc)


def bound(server: web_server.Server, max_connections: int,
          header_timeout_s: float) -> None:
    """Make ``server`` hand out bounded connections (see the module docstring)."""
    server.__class__ = _Bounded
    server.max_connections = max_connections
    server.header_timeout_s = header_timeout_s


def head_came(request, header_timeout_s: float):
    """A request's head arrived on its connection (the middleware's first step); returns
    a callback that re-arms the deadline for the next head once the answer went out."""
    conn = request.protocol
    if not isinstance(conn, _Connection):
        return lambda: None
    conn.head_came()
    return lambda: conn.wait_for_head(header_timeout_s) if conn.transport else None
