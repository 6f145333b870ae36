"""A cap on open HTTP connections: past max_connections a new one gets a short 503 and is closed.

aiohttp has no such limit of its own. ``CappedTCPSite`` listens like ``web.TCPSite``
but hands each accepted connection to ``ConnectionCap``, which counts the open ones
(it wraps aiohttp's protocol, so the count is exact even when many connections
arrive in one loop iteration) and answers the ones over the cap itself, without
parsing or routing anything: a fixed 503 in OpenAI's error shape, with Retry-After.
Idle keep-alive connections count too: they hold a socket like any other.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import Callable

from aiohttp import web

log = logging.getLogger(__name__)

SEND_BUFFER = 64 << 10  # bytes of socket send buffer per connection (the kernel doubles it)
_HEAD_LIMIT = 16384  # bytes of a refused request we read before answering anyway
_REFUSED_GRACE = 1.0  # seconds a refused client has to send its request head and read the answer


def _refusal(limit: int) -> bytes:
    body = json.dumps({"error": {
        "message": f"syshaxd has {limit} open connections (max_connections); close idle ones or retry shortly.",
        "type": "server_error", "param": None, "code": "too_many_connections"}}).encode()
    head = ("HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n")
    return head.encode() + body


class ConnectionCap:
    """Counts open connections and refuses those past the limit; bind() it to the runner's server."""

    def __init__(self, limit: int, first_byte_timeout: Callable[[], float] = lambda: 0.0) -> None:
        self.limit = limit
        self.first_byte_timeout = first_byte_timeout  # seconds a new connection may stay silent (0: forever)
        self.open = 0
        self.refused = 0
        self.silent_closed = 0
        self._server: web.Server | None = None
        self._answer = _refusal(limit)
        self._last_warning = 0.0

    def bind(self, server: web.Server) -> "ConnectionCap":
        self._server = server
        return self

    def stats(self) -> dict:
        return {"open": self.open, "max_connections": self.limit, "refused": self.refused,
                "closed_silent": self.silent_closed}

    def __call__(self) -> asyncio.BaseProtocol:
        """The protocol for one accepted connection (asyncio's protocol factory)."""
        if self.open >= self.limit:
            self.refused += 1
            now = time.monotonic()
            if now - self._last_warning > 10.0:  # one line per burst, not one per connection
                self._last_warning = now
                log.warning("refusing new HTTP connections: %d open (max_connections %d); %d refused so far",
                            self.open, self.limit, self.refused)
            return _Refused(self._answer)
        assert self._server is not None, "ConnectionCap.bind() was not called"
        self.open += 1
        return _Counted(self._server(), self)


class _Counted(asyncio.Protocol):
    """aiohttp's protocol for one connection, and one decrement of the count when it is lost."""

    __slots__ = ("_inner", "_cap", "_done", "_silence")

    def __init__(self, inner: asyncio.Protocol, cap: ConnectionCap) -> None:
        self._inner = inner
        self._cap = cap
        self._done = False
        self._silence: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        sock = transport.get_extra_info("socket")
        if sock is not None:
            # What the kernel holds for a client that does not read, before our writes wait (and
            # client_timeout lets it go). Left to autotuning, loopback buffers take megabytes: a whole
            # long answer, generated for nobody.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
        timeout = self._cap.first_byte_timeout()
        if timeout > 0:  # a connection that never sends a byte holds a socket for nothing
            self._silence = asyncio.get_running_loop().call_later(timeout, self._close_silent, transport)
        self._inner.connection_made(transport)

    def _close_silent(self, transport) -> None:
        self._silence = None
        self._cap.silent_closed += 1
        transport.close()

    def data_received(self, data: bytes) -> None:
        if self._silence is not None:
            self._silence.cancel()
            self._silence = None
        self._inner.data_received(data)

    def eof_received(self):
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc) -> None:
        if self._silence is not None:
            self._silence.cancel()
            self._silence = None
        if not self._done:
            self._done = True
            self._cap.open -= 1
        self._inner.connection_lost(exc)


class _Refused(asyncio.Protocol):
    """Read the request head (briefly), answer 503, close: the client sees an HTTP error, not a reset."""

    def __init__(self, answer: bytes) -> None:
        self._answer = answer
        self._seen = b""
        self._transport = None
        self._answered = False
        self._timer = None

    def connection_made(self, transport) -> None:
        self._transport = transport
        self._timer = asyncio.get_running_loop().call_later(_REFUSED_GRACE, self._close)

    def data_received(self, data: bytes) -> None:
        if self._answered:
            return  # the rest of the body: read and dropped, so closing does not reset the connection
        self._seen = (self._seen + data)[-_HEAD_LIMIT:]
        if b"\r\n\r\n" in self._seen or len(self._seen) >= _HEAD_LIMIT:
            self._reply()

    def eof_received(self):
        self._reply()
        self._close()
        return False

    def _reply(self) -> None:
        if self._answered or self._transport is None or self._transport.is_closing():
            return
        self._answered = True
        self._transport.write(self._answer)
        if self._transport.can_write_eof():
            self._transport.write_eof()

    def _close(self) -> None:
        self._reply()  # a client that sent nothing yet still gets the answer before the close
        if self._transport is not None:
            self._transport.close()

    def connection_lost(self, exc) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._transport = None


def ensure_file_limit(connections: int, spare: int = 256) -> int:
    """Raise the soft open-file limit so that `connections` sockets fit (plus spare); returns the limit.

    Without this, accept() would fail with EMFILE below max_connections (systemd's soft default is 1024).
    """
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = connections + spare
    if soft < need and (hard == resource.RLIM_INFINITY or soft < hard):
        soft = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    if soft < need:
        log.warning("the open-file limit is %d (ulimit -n; LimitNOFILE= in the unit): fewer than max_connections "
                    "%d plus %d for the daemon itself; new connections may fail before the cap", soft,
                    connections, spare)
    return soft


class CappedTCPSite(web.TCPSite):
    """web.TCPSite whose connections go through the app's ConnectionCap (api.keys.CONNECTIONS)."""

    async def start(self) -> None:
        from syshaxd.api.keys import CONNECTIONS

        await web.BaseSite.start(self)  # registers the site with the runner, as TCPSite.start does
        cap = self._runner.app[CONNECTIONS].bind(self._runner.server)
        ensure_file_limit(cap.limit)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(cap, self._host, self._port, ssl=self._ssl_context,
                                                backlog=self._backlog, reuse_address=self._reuse_address,
                                                reuse_port=self._reuse_port)
        self._bound_port = self._server.sockets[0].getsockname()[1] if self._server.sockets else self._port
