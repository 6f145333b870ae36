"""Server-sent events, for every endpoint that streams: the headers, the writes within client_timeout, a client
that leaves, a failure after the headers, and the stream's end.

Chat and completions send each chunk as `data: <json>` and end with `data: [DONE]`; the Responses and
Messages APIs send typed events (`event: <type>` and the event as data) and end with their own last
event. The endpoint gives its events, how one is framed, what a failure after the first event becomes,
and what ends the stream.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from aiohttp import web

from syshaxd.api.core.app_keys import STATE
from syshaxd.api.core.errors import APIError

log = logging.getLogger(__name__)


class ClientGone(Exception):
    """The client closed the connection while we waited; nobody is left to answer."""


def json_bytes(obj) -> bytes:
    """obj as every event writes it: JSON, UTF-8 unescaped."""
    return json.dumps(obj, ensure_ascii=False).encode()


def data(obj: dict | bytes) -> bytes:
    """One `data:` event (chat's and completions' chunks): a chunk, or one already JSON (Exchange.text_chunk)."""
    return b"data: " + (obj if isinstance(obj, bytes) else json_bytes(obj)) + b"\n\n"


def typed(event: dict) -> bytes:
    """One typed event: `event: <type>` and the event as data (the Responses and Messages APIs)."""
    return f"event: {event['type']}\ndata: ".encode() + json_bytes(event) + b"\n\n"


DONE = b"data: [DONE]\n\n"


E = TypeVar("E")  # an endpoint's events: dicts, and for chat and completions chunks already JSON (bytes) too


class Batch(list):
    """Events that are ready together (a choice's last text, its finish, the usage), sent in one write: each write
    is a system call here and a wake-up of the client. `last`: nothing follows but the stream's end, which goes in
    the same write."""

    def __init__(self, events=(), last: bool = False) -> None:
        super().__init__(events)
        self.last = last


@dataclass(frozen=True)
class Framing(Generic[E]):
    """How an endpoint's stream is written: each event's bytes, the event a failure after the first one becomes
    (given the error and the events sent), and the bytes that end a stream that ran to its end or failed."""

    frame: Callable[[E], bytes]
    failed: Callable[[APIError, int], E]
    end: bytes = b""


OPENAI: Framing[dict | bytes] = Framing(data, lambda exc, sent: exc.body(), DONE)


class PassWrites:
    """The streams' writes of one pass of the event loop, made together when it ends (one per app: PASS_WRITES).

    One engine step gives a token to every stream of its batch at once, and each stream's handler runs in turn to
    write it. Written as each handler comes to it, the writes spread over the whole pass, and the client (on
    these cores, or any that reads many streams) is woken for each; held to the pass's end they go out back to
    back, and one wake-up reads them all. The pass's later handlers wait for none of it: a token's write is delayed
    by what the pass still had to do, not by a timer."""

    def __init__(self) -> None:
        self._held: list[StreamWrites] = []

    def hold(self, writes: "StreamWrites") -> None:
        if not self._held:
            asyncio.get_running_loop().call_soon(self._write)
        self._held.append(writes)

    def _write(self) -> None:
        held, self._held = self._held, []
        for writes in held:
            writes.flush()


PASS_WRITES = web.AppKey("pass_writes", PassWrites)


class StreamWrites:
    """A stream's writes: held to the end of the event loop's pass (PassWrites), and given up with TimeoutError
    after `timeout` seconds once the client stops reading.

    A write is held only where aiohttp's own would not wait: the headers went (aiohttp sends them with the first
    write), the transport is not paused, and what it buffers with what is held stays within its high-water mark.
    A held write goes to the transport as aiohttp's chunked encoding frames it; anything else (the first write, a
    full buffer, an HTTP/1.0 client without chunked encoding, the end) goes through aiohttp, after what is held,
    timed from the moment the client's buffers are full. The transport and its mark are read once: they are the
    connection's for the whole stream."""

    def __init__(self, request: web.Request, resp: web.StreamResponse, timeout: float, passes: PassWrites) -> None:
        self.resp = resp
        self.timeout = timeout
        self.protocol = request.protocol
        self.transport = request.transport
        self.high = self.transport.get_write_buffer_limits()[1] if self.transport is not None else 0
        self.opened = False  # aiohttp wrote the headers (with the first write)
        # aiohttp frames the body in HTTP chunks (HTTP/1.1) and does not compress it: its headers say so once prepared
        self.chunked = (resp.headers.get("Transfer-Encoding", "").lower() == "chunked"
                        and "Content-Encoding" not in resp.headers)
        self._held: list[bytes] = []
        self._held_bytes = 0
        self._pass = passes

    def hold(self, chunk: bytes) -> bool:
        """Hold chunk for the end of the loop's pass (True), or leave it to write() (False)."""
        transport = self.transport
        if not (self.opened and self.chunked and transport is not None and not transport.is_closing()
                and not getattr(self.protocol, "writing_paused", True)
                and transport.get_write_buffer_size() + self._held_bytes + len(chunk) <= self.high):
            return False
        if not self._held:
            self._pass.hold(self)
        self._held.append(chunk)
        self._held_bytes += len(chunk)
        return True

    def flush(self) -> None:
        """What is held, to the transport now, as one HTTP chunk (dropped where the connection closed: the handler
        hears of it at its next write)."""
        if not self._held:
            return
        data = b"".join(self._held)
        self._held.clear()
        self._held_bytes = 0
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        try:
            transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        except Exception:  # never lose the pass's other writes: this stream's connection ends, its handler hears
            log.exception("a held stream write failed; closing that connection")
            transport.abort()

    async def write(self, chunk: bytes) -> None:
        """chunk through aiohttp, after what is held (where hold() did not take it: rarely more than once a stream)."""
        self.flush()
        self.opened = True
        async with asyncio.timeout(self.timeout):
            await self.resp.write(chunk)

    async def end(self, chunk: bytes) -> None:
        """The last events and the stream's end, in one write after what is held (once a stream: always timed)."""
        self.flush()
        async with asyncio.timeout(self.timeout):
            await self.resp.write_eof(chunk)


async def stream(request: web.Request, route: Callable[[], str], request_id: str, events: AsyncIterator[E | Batch],
                 framing: Framing[E]) -> web.StreamResponse:
    """The events as server-sent events. The headers (route(): where the request runs) wait for the first event
    (an error before it is a proper HTTP error); a client that leaves or stops reading for client_timeout ends the
    stream. A Batch's events are one write; after a failure past the first event, the stream ends with
    framing.failed(error, events sent) and the end."""
    try:
        event = await anext(events)
    except StopAsyncIteration:  # no event at all: the headers and the end
        event = Batch(last=True)
    except BaseException:
        await _close(events)
        raise
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no", "X-Syshax-Route": route()})
    await resp.prepare(request)
    timeout = request.app[STATE].config.client_timeout
    writes = StreamWrites(request, resp, timeout, request.app[PASS_WRITES])
    frame, sent = framing.frame, 0
    try:
        try:
            # one loop from the engine's event to the socket, no generator between: a stream runs it per token
            while True:
                if isinstance(event, Batch):
                    chunk = b"".join([frame(e) for e in event])
                    if event.last:
                        chunk += framing.end
                        break
                else:
                    chunk = frame(event)
                # a write waits while the client's socket buffers are full: a client that stops reading is let go
                if not writes.hold(chunk):
                    await writes.write(chunk)
                sent += 1
                event = await anext(events)
        except StopAsyncIteration:
            chunk = framing.end
        except APIError as exc:
            chunk = frame(framing.failed(exc, sent)) + framing.end
        await writes.end(chunk)
    except ClientGone:
        log.info("%s: client left mid-stream", request_id)
    except (ConnectionResetError, ConnectionError):
        log.info("%s: client disconnected mid-stream", request_id)
    except asyncio.TimeoutError:  # the caller's run() cancels the request and frees its sequence
        log.info("%s: client read nothing of the stream for %gs (client_timeout); cancelled", request_id, timeout)
        if request.transport is not None:
            request.transport.abort()  # what it has not read goes: it is not reading
    finally:
        writes.flush()  # what is held goes before anything aiohttp writes after the handler
        await _close(events)
    return resp


class SourceFailed(Exception):
    """The stream relay() passes on broke off after its headers went; the client's connection was closed."""


async def relay(request: web.Request, status: int, headers: dict, chunks: AsyncIterator[bytes], what: str,
                started: Callable[[web.StreamResponse], None]) -> web.StreamResponse:
    """Another server's stream passed on as it comes (a chat model's daemon: api/core/model_proxy.py): its status and
    headers, each chunk within client_timeout, its end. `started` hears of the response once its headers went. A
    client that leaves or stops reading ends it as any stream here; `chunks` failing after the headers closes the
    client's connection (its client sees a broken answer, never a short whole one) and raises SourceFailed."""
    resp = web.StreamResponse(status=status, headers=headers)
    await resp.prepare(request)
    started(resp)
    timeout = request.app[STATE].config.client_timeout
    writes = StreamWrites(request, resp, timeout, request.app[PASS_WRITES])
    try:
        while True:
            try:
                chunk = await anext(chunks)
            except StopAsyncIteration:
                break
            except Exception as exc:
                writes.flush()
                if request.transport is not None:
                    request.transport.close()
                raise SourceFailed(f"{type(exc).__name__}: {exc}") from exc
            if not writes.hold(chunk):
                await writes.write(chunk)
        await writes.end(b"")
    except (ConnectionResetError, ConnectionError):
        log.info("%s: client disconnected mid-stream", what)
    except asyncio.TimeoutError:
        log.info("%s: client read nothing of the stream for %gs (client_timeout); cancelled", what, timeout)
        if request.transport is not None:
            request.transport.abort()  # what it has not read goes: it is not reading
    finally:
        writes.flush()
    return resp


async def _close(events: AsyncIterator) -> None:
    """Close the events' iterator (an endpoint's generator: its reading of the engines ends with it)."""
    aclose = getattr(events, "aclose", None)
    if aclose is not None:
        await aclose()
