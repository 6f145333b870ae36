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
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from aiohttp import web

from syshaxd.api.errors import APIError
from syshaxd.api.keys import STATE

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


@dataclass(frozen=True)
class Framing(Generic[E]):
    """How an endpoint's stream is written: each event's bytes, the event a failure after the first one becomes
    (given the error and the events sent), and the bytes that end a stream that ran to its end or failed."""

    frame: Callable[[E], bytes]
    failed: Callable[[APIError, int], E]
    end: bytes = b""


OPENAI: Framing[dict | bytes] = Framing(data, lambda exc, sent: exc.body(), DONE)


async def write_within(request: web.Request, resp: web.StreamResponse, chunk: bytes, timeout: float) -> None:
    """resp.write(chunk), given up with TimeoutError after `timeout` seconds (a client that stops reading).

    A stream writes once per token, so the usual write arms no timer: aiohttp's write waits only while the
    transport is paused, and one that is not paused and takes the chunk within its high-water mark does not pause
    for it. A client that stops reading fills the buffer to the mark, and its writes are timed from then on."""
    transport = request.transport
    if (transport is not None and not getattr(request.protocol, "writing_paused", True)
            and transport.get_write_buffer_size() + len(chunk) <= transport.get_write_buffer_limits()[1]):
        await resp.write(chunk)
        return
    async with asyncio.timeout(timeout):
        await resp.write(chunk)


async def _framed(events: AsyncIterator[E], framing: Framing[E]) -> AsyncGenerator[bytes, None]:
    """The events as bytes. A failure before the first event is the caller's HTTP error; after it, the stream
    ends with framing.failed(error, events sent) and the end."""
    sent = 0
    try:
        async for event in events:
            sent += 1
            yield framing.frame(event)
    except APIError as exc:
        if not sent:
            raise
        yield framing.frame(framing.failed(exc, sent))
    if framing.end:
        yield framing.end


async def stream(request: web.Request, route: Callable[[], str], request_id: str, events: AsyncIterator[E],
                 framing: Framing[E]) -> web.StreamResponse:
    """The events as server-sent events. The headers (route(): where the request runs) wait for the first event
    (an error before it is a proper HTTP error); a client that leaves or stops reading for client_timeout ends the
    stream."""
    chunks = _framed(events, framing)
    try:
        first = await anext(chunks)
    except BaseException:
        await chunks.aclose()
        raise
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no", "X-Syshax-Route": route()})
    await resp.prepare(request)
    timeout = request.app[STATE].config.client_timeout
    try:
        await write_within(request, resp, first, timeout)
        async for chunk in chunks:
            # a write waits while the client's socket buffers are full: a client that stops reading is let go
            await write_within(request, resp, chunk, timeout)
        await resp.write_eof()
    except ClientGone:
        log.info("%s: client left mid-stream", request_id)
    except (ConnectionResetError, ConnectionError):
        log.info("%s: client disconnected mid-stream", request_id)
    except asyncio.TimeoutError:  # the caller's run() cancels the request and frees its sequence
        log.info("%s: client read nothing of the stream for %gs (client_timeout); cancelled", request_id, timeout)
        if request.transport is not None:
            request.transport.abort()  # what it has not read goes: it is not reading
    finally:
        await chunks.aclose()
    return resp
