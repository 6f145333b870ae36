"""A cap on open HTTP connections: past max_connections a new one gets a short 503 and is closed.

aiohttp has no such limit of its own. ``CappedTCPSite`` listens like ``web.TCPSite``
but hands each accepted connection to ``ConnectionCap``, which counts the open ones
(it wraps aiohttp's protocol, so the count is exact even when many connections
arrive in one loop iteration) and answers the ones over the cap itself, without
parsing or routing anything: a fixed 503 in OpenAI's error shape, with Retry-After.
Idle keep-alive connections count too: they hold a socket like any other.

aiohttp has no timeout on a request head either: a client that sends one header byte a second
holds its connection forever. ``_HeadWatch`` follows each connection's bytes just far enough to
know when it is inside a request head (the ends of heads, and bodies by their Content-Length),
and a head not complete within client_timeout closes the connection; so does a new connection
that sends nothing at all.
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

    def __init__(self, limit: int, head_timeout: Callable[[], float] = lambda: 0.0) -> None:
        self.limit = limit
        # seconds a new connection may stay silent, and any request head may take to arrive (0: forever)
        self.head_timeout = head_timeout
        self.open = 0
        self.refused = 0
        self.silent_closed = 0
        self.slow_head_closed = 0
        self._server: web.Server | None = None
        self._answer = _refusal(limit)
        self._last_warning = 0.0
        self._last_slow_head_log = 0.0

    def bind(self, server: web.Server) -> "ConnectionCap":
        self._server = server
        return self

    def closed_slow_head(self) -> None:
        self.slow_head_closed += 1
        now = time.monotonic()
        if now - self._last_slow_head_log > 10.0:  # one line per burst, not one per connection
            self._last_slow_head_log = now
            log.info("closed a connection whose request head did not arrive within %gs (client_timeout); "
                     "%d so far", self.head_timeout(), self.slow_head_closed)

    def stats(self) -> dict:
        return {"open": self.open, "max_connections": self.limit, "refused": self.refused,
                "closed_silent": self.silent_closed, "closed_slow_head": self.slow_head_closed}

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


class _HeadWatch:
    """Whether a connection's byte stream is inside a request head, followed by feed() as bytes arrive.

    Between heads it skips each body by its Content-Length. A chunked body, or a head too large to
    be one aiohttp accepts (it answers that itself), ends the watch: the connection is then bounded
    by the 408 on its body and aiohttp's keep-alive timeout.
    """

    __slots__ = ("_head", "_body_left", "given_up")

    _MAX_HEAD = 64 << 10  # aiohttp refuses far smaller heads (8190 bytes a line) with its own 400

    def __init__(self) -> None:
        self._head = bytearray()  # the current head so far
        self._body_left = 0
        self.given_up = False

    @property
    def in_head(self) -> bool:
        return bool(self._head) and not self.given_up

    def feed(self, data: bytes) -> None:
        i = 0
        while i < len(data) and not self.given_up:
            if self._body_left:
                taken = min(self._body_left, len(data) - i)
                self._body_left -= taken
                i += taken
                continue
            seen = len(self._head)
            self._head += data[i:]
            end = self._head.find(b"\r\n\r\n", max(seen - 3, 0))
            if end < 0:
                self.given_up = len(self._head) > self._MAX_HEAD
                return
            i += end + 4 - seen
            self._body_left = self._body_length(bytes(self._head[:end]))
            self._head.clear()

    def _body_length(self, head: bytes) -> int:
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length" and value.strip().isdigit():
                length = int(value.strip())
            elif name == b"transfer-encoding" or name == b"content-length":  # chunked, or not a length we read
                self.given_up = True
        return length


class _Counted(asyncio.Protocol):
    """aiohttp's protocol for one connection, one decrement of the count when it is lost, and the head timeout."""

    __slots__ = ("_inner", "_cap", "_done", "_deadline", "_watch", "_transport", "_received")

    def __init__(self, inner: asyncio.Protocol, cap: ConnectionCap) -> None:
        self._inner = inner
        self._cap = cap
        self._done = False
        self._deadline: asyncio.TimerHandle | None = None  # armed while a head is awaited
        self._watch = _HeadWatch()
        self._transport = None
        self._received = False

    def connection_made(self, transport) -> None:
        sock = transport.get_extra_info("socket")
        if sock is not None:
            # What the kernel holds for a client that does not read, before our writes wait (and
            # client_timeout lets it go). Left to autotuning, loopback buffers take megabytes: a whole
            # long answer, generated for nobody.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
        self._transport = transport
        self._arm()  # a connection that never sends a byte holds a socket for nothing
        self._inner.connection_made(transport)

    def _arm(self) -> None:
        timeout = self._cap.head_timeout()
        if timeout > 0 and self._deadline is None:
            self._deadline = asyncio.get_running_loop().call_later(timeout, self._close_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _close_slow(self) -> None:
        self._deadline = None
        if self._received:
            self._cap.closed_slow_head()
        else:
            self._cap.silent_closed += 1
        if self._transport is not None:
            self._transport.close()

    def data_received(self, data: bytes) -> None:
        self._received = True
        if not self._watch.given_up:
            self._watch.feed(data)
            if self._watch.in_head:
                self._arm()  # from a head's first byte; a running timer keeps its start
            else:
                self._disarm()  # between requests aiohttp's keep-alive timeout applies; bodies get 408
        self._inner.data_received(data)

    def eof_received(self):
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc) -> None:
        self._disarm()
        self._transport = None
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
        self._timer: asyncio.TimerHandle | None = None

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
    """web.TCPSite whose connections go through `cap`, the app's ConnectionCap (api.core.app_keys.CONNECTIONS)."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, cap: ConnectionCap) -> None:
        super().__init__(runner, host, port)
        self._cap = cap

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with the runner, as TCPSite.start does
        server = self._runner.server
        if server is None:
            raise RuntimeError("the site's runner is not set up (runner.setup() first)")
        cap = self._cap.bind(server)
        ensure_file_limit(cap.limit)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(cap, self._host, self._port, ssl=self._ssl_context,
                                                backlog=self._backlog, reuse_address=self._reuse_address,
                                                reuse_port=self._reuse_port)
        self._bound_port = self._server.sockets[0].getsockname()[1] if self._server.sockets else self._port
