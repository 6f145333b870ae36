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

from syshaxd.api.core import sse
from syshaxd.api.core.app_keys import SCHEDULER, STATE
from syshaxd.api.core.errors import APIError, invalid
from syshaxd.api.core.generation import read_body
from syshaxd.api.core.outputs import client_gone
from syshaxd.api.core.state import Draining
from syshaxd.engine.chat_models import ChatModel, ChildDaemon
from syshaxd.engine.engine_handle import EngineUnavailable
from syshaxd.engine.lifecycle import HandleState
from syshaxd.model_entries import EntryError, seconds

log = logging.getLogger(__name__)

# the requests that name their model in a JSON body; the rest (status, metrics, the web page) stay here
FORWARDED = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                       "/v1/messages/count_tokens", "/tokenize", "/detokenize"})
# not passed on either way: hop-by-hop, the body's framing (set again), and the client's own key
_DROPPED = frozenset({"host", "connection", "keep-alive", "transfer-encoding", "content-length", "te", "trailer",
                      "upgrade", "proxy-authorization", "authorization", "x-api-key", "content-encoding", "date",
                      "server"})
CLIENT_CHECK = 0.5  # seconds between looks at whether the client is still there while the child answers
METRICS_TIMEOUT = 2.0  # seconds a chat model's daemon has to answer this daemon's scrape of its /metrics


@web.middleware
async def forward_to_chat_model(request: web.Request, handler):
    """A request whose body names a chat model of [[models]] is that model's daemon's to answer."""
    entries = request.app[SCHEDULER].entries
    if request.method != "POST" or request.path not in FORWARDED or not entries.of_kind("chat"):
        return await handler(request)
    try:
        body = await read_body(request)  # within client_timeout: a body that trickles in is a 408
    except APIError as exc:
        if exc.status == 408:
            raise
        return await handler(request)  # the handler answers a malformed body as it always does
    name = body.get("model")
    model = entries[name] if isinstance(name, str) and name in entries else None
    if not isinstance(model, ChatModel):
        return await handler(request)
    ask_keep_alive(model, body)
    # keep_alive is this daemon's to apply; the model's daemon, which loads nothing, refuses a field it does not read
    data = json.dumps({k: v for k, v in body.items() if k != "keep_alive"}).encode() if "keep_alive" in body \
        else await request.read()
    try:
        with request.app[STATE].one_request():
            return await _forwarded(request, entries, model, data)
    except Draining as exc:
        raise APIError(503, f"syshaxd is draining ({exc}) and takes no new requests; retry shortly or send the "
                       "request to another instance.", type="server_error", code="draining",
                       headers={"Retry-After": "5"}) from None


async def _forwarded(request: web.Request, entries, model: ChatModel, data: bytes) -> web.StreamResponse:
    """The child's answer; a 499 when the client leaves first (the load, and the child's request, are dropped)."""
    timeout = request.app[STATE].config.request_timeout
    exchange = Exchange(request, model, data)
    task = asyncio.ensure_future(exchange.run(entries, time.monotonic() + timeout))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=CLIENT_CHECK)
            if done:
                return task.result()
            if client_gone(request):
                task.cancel()  # closes the child's request too: the child frees its slot
                await asyncio.gather(task, return_exceptions=True)
                log.info("%s: client left; its request to chat model %s is closed", request.path, model.name)
                if exchange.response is not None and exchange.response.prepared:
                    return exchange.response
                return web.Response(status=499, text="client closed the request")
    finally:
        if not task.done():
            task.cancel()


class Exchange:
    """One request passed on to a chat model's daemon, and its answer passed back."""

    def __init__(self, request: web.Request, model: ChatModel, data: bytes) -> None:
        self.request = request
        self.model = model
        self.data = data  # the body passed on
        self.response: web.StreamResponse | None = None  # once a stream has begun

    async def run(self, entries, deadline: float) -> web.StreamResponse:
        model = self.model
        try:
            child = await model.load(deadline, entries.make_room)
        except EngineUnavailable as exc:
            raise APIError(503, str(exc), type="server_error", code="model_unavailable",
                           headers={} if exc.final else {"Retry-After": "5"}) from None
        assert isinstance(child, ChildDaemon)
        model.active += 1  # no await since load() returned: an unload waits for this request
        try:
            return await self._relay(child)
        finally:
            model.active -= 1
            model.last_used = time.monotonic()
            model.requests += 1

    def _started(self, response: web.StreamResponse) -> None:
        self.response = response

    async def _relay(self, child: ChildDaemon) -> web.StreamResponse:
        request, model = self.request, self.model
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROPPED}
        headers["Authorization"] = f"Bearer {child.key}"
        try:
            async with child.session().post(child.url + request.path_qs, data=self.data,
                                            headers=headers, auto_decompress=False) as upstream:
                back = {k: v for k, v in upstream.headers.items() if k.lower() not in _DROPPED}
                if not upstream.headers.get("Content-Type", "").startswith("text/event-stream"):
                    body = await upstream.read()
                    return web.Response(status=upstream.status, body=body, headers=back)
                what = f"{request.path} to chat model {model.name}"
                try:  # a stream is written as every stream here (sse.py): client_timeout, a client that leaves
                    return await sse.relay(request, upstream.status, back, upstream.content.iter_any(), what,
                                           self._started)
                except sse.SourceFailed as exc:  # its daemon failed mid-stream
                    model.failed_requests += 1
                    log.warning("%s: the stream broke off (%s); the client's connection is closed", what, exc)
                    assert self.response is not None
                    return self.response
        except (aiohttp.ClientError, ConnectionError, asyncio.TimeoutError) as exc:
            if client_gone(request):
                return web.Response(status=499, text="client closed the request")
            model.failed_requests += 1
            raise APIError(503, f"chat model {model.name}'s daemon did not answer ({type(exc).__name__}: {exc}); "
                           "it is started again at the next request; retry", type="server_error",
                           code="model_unavailable", headers={"Retry-After": "5"}) from None


def ask_keep_alive(model, body: dict) -> None:
    """A request's keep_alive (Ollama's field: seconds, "5m", -1 never, 0 at once): how long `model` stays loaded
    after it, until it is unloaded; a 400 when it is no duration."""
    if body.get("keep_alive") is None:
        return
    try:
        model.keep_alive_asked = seconds(body["keep_alive"], "keep_alive")
    except EntryError as exc:
        raise invalid(f"Invalid {exc}", param="keep_alive") from None


async def chat_model_metrics(entries) -> list:
    """The per-model families (those labelled model_name, as vLLM's) of each chat model's daemon that serves now,
    for this daemon's /metrics; a daemon that does not answer within METRICS_TIMEOUT is left out of this scrape."""
    from prometheus_client.parser import text_string_to_metric_families

    async def scrape(model: ChatModel, child: ChildDaemon) -> list:
        try:
            async with child.session().get(child.url + "/metrics", headers={"Authorization": f"Bearer {child.key}",
                                                                            "Accept": "text/plain"},
                                           timeout=aiohttp.ClientTimeout(total=METRICS_TIMEOUT)) as resp:
                text = await resp.text() if resp.status == 200 else ""
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError):
            return []
        families = []
        try:
            for family in text_string_to_metric_families(text):
                family.samples = [s for s in family.samples if s.labels.get("model_name") == model.name
                                  and not s.name.endswith("_created")]  # (written by the exposition itself)
                if family.samples and not family.name.endswith("_created"):
                    families.append(family)
        except ValueError:  # an exposition cut short (its daemon stopping): this scrape goes without it
            return []
        return families

    served = [(m, m.handle) for m in entries.of_kind("chat")
              if isinstance(m.handle, ChildDaemon) and m.handle.state == HandleState.READY]
    found = await asyncio.gather(*(scrape(m, child) for m, child in served))
    return [family for families in found for family in families]
