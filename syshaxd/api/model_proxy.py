"""Requests for a chat model of [[models]] go to the syshaxd that serves it (engine/chat_models.py): loaded first
where it is not (within request_timeout), then the request passed on as it came and the answer passed back as it
goes, a stream chunk by chunk. The API key was checked here; the child is reached on loopback with its own key.

A client that leaves closes the child's request too, so the child frees its slot as for any client that leaves.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import aiohttp
from aiohttp import web

from syshaxd.api.errors import APIError
from syshaxd.api.keys import SCHEDULER, STATE
from syshaxd.api.state import Draining
from syshaxd.engine.chat_models import ChatModel, ChildDaemon
from syshaxd.engine.supervisor import EngineUnavailable

log = logging.getLogger(__name__)

# the requests that name their model in a JSON body; the rest (status, metrics, the web page) stay here
FORWARDED = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                       "/v1/messages/count_tokens", "/tokenize", "/detokenize"})
# not passed on either way: hop-by-hop, the body's framing (set again), and the client's own key
_DROPPED = frozenset({"host", "connection", "keep-alive", "transfer-encoding", "content-length", "te", "trailer",
                      "upgrade", "proxy-authorization", "authorization", "x-api-key", "content-encoding", "date",
                      "server"})
CLIENT_CHECK = 0.5  # seconds between looks at whether the client is still there while the child answers


@web.middleware
async def forward_to_chat_model(request: web.Request, handler):
    """A request whose body names a chat model of [[models]] is that model's daemon's to answer."""
    entries = request.app[SCHEDULER].entries
    if request.method != "POST" or request.path not in FORWARDED or not entries.of_kind("chat"):
        return await handler(request)
    try:
        body = json.loads(await request.read())
    except (ValueError, UnicodeDecodeError):
        return await handler(request)  # the handler answers the malformed body as it always does
    name = body.get("model") if isinstance(body, dict) else None
    model = entries[name] if isinstance(name, str) and name in entries else None
    if not isinstance(model, ChatModel):
        return await handler(request)
    try:
        with request.app[STATE].one_request():
            return await _forwarded(request, entries, model)
    except Draining as exc:
        raise APIError(503, f"syshaxd is draining ({exc}) and takes no new requests; retry shortly or send the "
                       "request to another instance.", type="server_error", code="draining",
                       headers={"Retry-After": "5"}) from None


async def _forwarded(request: web.Request, entries, model: ChatModel) -> web.StreamResponse:
    timeout = request.app[STATE].config.request_timeout
    try:
        child = await model.load(time.monotonic() + timeout, entries.make_room)
    except EngineUnavailable as exc:
        raise APIError(503, str(exc), type="server_error", code="model_unavailable",
                       headers={} if exc.final else {"Retry-After": "5"}) from None
    assert isinstance(child, ChildDaemon)
    model.active += 1  # no await since load() returned: an unload waits for this request
    try:
        return await _relay(request, model, child)
    finally:
        model.active -= 1
        model.last_used = time.monotonic()
        model.requests += 1


async def _relay(request: web.Request, model: ChatModel, child: ChildDaemon) -> web.StreamResponse:
    headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROPPED}
    headers["Authorization"] = f"Bearer {child.key}"
    watch = None
    response: web.StreamResponse | None = None
    try:
        async with child.session().post(child.url + request.path_qs, data=await request.read(), headers=headers,
                                        auto_decompress=False) as upstream:
            watch = asyncio.ensure_future(_close_when_gone(request, upstream))
            back = {k: v for k, v in upstream.headers.items() if k.lower() not in _DROPPED}
            if not upstream.headers.get("Content-Type", "").startswith("text/event-stream"):
                body = await upstream.read()
                return web.Response(status=upstream.status, body=body, headers=back)
            response = web.StreamResponse(status=upstream.status, headers=back)
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response
    except (aiohttp.ClientError, ConnectionError, asyncio.TimeoutError) as exc:
        if response is not None and response.prepared:  # the stream has begun: it ends where the child's did
            log.info("%s: the stream from chat model %s ended early (%s)", request.path, model.name,
                     "the client left" if _gone(request) else type(exc).__name__)
            return response
        if _gone(request):
            log.info("%s: client left; its request to chat model %s is closed", request.path, model.name)
            return web.Response(status=499, text="client closed the request")
        model.failed_requests += 1
        raise APIError(503, f"chat model {model.name}'s daemon did not answer ({type(exc).__name__}: {exc}); it "
                       "is started again at the next request; retry", type="server_error",
                       code="model_unavailable", headers={"Retry-After": "5"}) from None
    finally:
        if watch is not None:
            watch.cancel()


async def _close_when_gone(request: web.Request, upstream: aiohttp.ClientResponse) -> None:
    """Close the child's answer once the client has gone: the child sees its client leave and frees the slot."""
    while not _gone(request):
        await asyncio.sleep(CLIENT_CHECK)
    upstream.close()


def _gone(request: web.Request) -> bool:
    return request.transport is None or request.transport.is_closing()
