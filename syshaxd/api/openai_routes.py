"""The OpenAI-compatible endpoints: completions, chat completions (JSON or SSE), models, health, metrics, OpenAPI."""

from __future__ import annotations

import asyncio
import json
import logging
import time

from aiohttp import web

from syshaxd import __version__
from syshaxd.api.errors import APIError
from syshaxd.api.keys import CONNECTIONS, METRICS, MODEL_NAME, OPENAPI, SCHEDULER, STARTED, STATE
from syshaxd.api.long_strings import check_strings
from syshaxd.api.state import Draining
from syshaxd.api.validate import ParsedRequest, parse_chat, parse_completion, parse_json_body
from syshaxd.engine.scheduler import Overloaded, RouteUnavailable
from syshaxd.engine.supervisor import EngineUnavailable
from syshaxd.engine.types import Accepted, Delta, Rejected, RequestStream
from syshaxd.metrics import RequestTimer

log = logging.getLogger(__name__)
routes = web.RouteTableDef()

SYSTEM_FINGERPRINT = f"syshax-{__version__}"
_DISCONNECT_POLL = 1.0  # seconds between checks that a waiting client is still there


class _ClientGone(Exception):
    """The client closed the connection while we waited; nobody is left to answer."""


class _Exchange:
    """The shapes of one endpoint's bodies and stream chunks."""

    def __init__(self, chat: bool, parsed: ParsedRequest, model: str) -> None:
        self.chat = chat
        self.id = parsed.generate.request_id
        self.created = int(time.time())
        self.model = model
        self.object = "chat.completion" if chat else "text_completion"

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": SYSTEM_FINGERPRINT}

    def body(self, text: str, finish: str, usage: dict, route: dict) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return self._head(self.object) | {"choices": [choice], "usage": usage, "syshax": route}

    def chunk(self, text: str | None, finish: str | None, role: bool = False) -> dict:
        if self.chat:
            delta: dict = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return self._head("chat.completion.chunk") | {"choices": [choice]}
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return self._head("text_completion") | {"choices": [choice]}

    def final_chunk(self, finish: str, route: dict) -> dict:
        """The chunk with the finish reason, and syshax's note of the route the request took."""
        return self.chunk(None if self.chat else "", finish) | {"syshax": route}

    def usage_chunk(self, usage: dict) -> dict:
        return self._head("chat.completion.chunk" if self.chat else "text_completion") | {
            "choices": [], "usage": usage}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def _next_event(request: web.Request, stream: RequestStream, deadline: float | None):
    """The stream's next event; None if the client left. Raises APIError past the deadline."""
    while True:
        timeout = _DISCONNECT_POLL
        if deadline is not None:
            timeout = min(timeout, max(deadline - time.monotonic(), 0.0))
        try:
            return await asyncio.wait_for(stream.next_event(), timeout)
        except asyncio.TimeoutError:
            if _client_gone(request):
                return None
            if deadline is not None and time.monotonic() >= deadline:
                raise APIError(503, "The request waited too long for the engine (request_timeout); retry later.",
                               type="server_error", code="timeout") from None


def _route_of(stream: RequestStream) -> dict:
    """Where the request ran: "cpu", "gpu" or "hetero"; in auto mode why, and whether its decode moved back."""
    route = {"route": stream.route}
    if stream.reason:
        route["reason"] = stream.reason
    if stream.moved_to:
        route["moved_to"] = stream.moved_to
    return route


def _rejected(event: Rejected) -> APIError:
    kind = "invalid_request_error" if event.status < 500 else "server_error"
    headers = {"Retry-After": "1"} if event.status == 503 else None  # the worker is being replaced
    return APIError(event.status, event.message, type=kind, param=event.param, code=event.code, headers=headers)


async def _start(request: web.Request, parsed: ParsedRequest) -> tuple[RequestStream, Accepted]:
    scheduler = request.app[SCHEDULER]
    try:
        stream = scheduler.submit(parsed.generate)
    except Overloaded as exc:
        raise APIError(429, str(exc), type="rate_limit_error", code="rate_limit_exceeded",
                       headers={"Retry-After": str(exc.retry_after)}) from None
    except RouteUnavailable as exc:
        raise APIError(400, str(exc), param="syshax.mode", code="unsupported_route") from None
    except EngineUnavailable as exc:
        raise APIError(503, str(exc), type="server_error", code="engine_unavailable",
                       headers={"Retry-After": "5"}) from None
    event = await _next_event(request, stream, time.monotonic() + 30.0)
    if event is None:
        stream.cancel()
        raise _ClientGone()
    if isinstance(event, Rejected):
        raise _rejected(event)
    if isinstance(event, Delta):  # the worker died before it could accept
        raise APIError(503, event.error or "the engine failed", type="server_error", code="engine_error")
    return stream, event


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    timer = request.app[METRICS].request()
    try:
        with request.app[STATE].admitted():  # a drain waits for the requests admitted here
            return await _generate_admitted(request, chat, timer)
    except Draining as exc:
        raise APIError(503, f"syshaxd is draining ({exc}) and takes no new requests; retry shortly or send the "
                       "request to another instance.", type="server_error", code="draining",
                       headers={"Retry-After": "5"}) from None


async def _generate_admitted(request: web.Request, chat: bool, timer: RequestTimer) -> web.StreamResponse:
    cfg = request.app[STATE].config
    try:
        raw = await asyncio.wait_for(request.read(), cfg.client_timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"The request body did not arrive within {cfg.client_timeout:g}s (client_timeout); "
                       "send the whole body at once.", code="request_timeout",
                       headers={"Connection": "close"}) from None
    body = parse_json_body(raw)
    check_strings(body, len(raw), cfg.max_string_bytes)
    parsed = (parse_chat(body, request.app[MODEL_NAME], cfg.default_max_tokens, cfg.max_messages) if chat
              else parse_completion(body, request.app[MODEL_NAME], cfg.default_max_tokens))
    try:
        stream, accepted = await _start(request, parsed)
    except _ClientGone:
        return web.Response(status=499, text="client closed the request")
    timer.accepted(accepted.prompt_tokens)
    exchange = _Exchange(chat, parsed, request.app[MODEL_NAME])
    try:
        if parsed.stream:
            return await _respond_stream(request, stream, accepted, exchange, parsed.include_usage, timer)
        return await _respond_json(request, stream, accepted, exchange, timer)
    except _ClientGone:
        log.info("%s: client left before the answer was ready", parsed.generate.request_id)
        return web.Response(status=499, text="client closed the request")
    finally:
        stream.cancel()  # no-op once finished; frees the sequence if the client left


async def _respond_json(request, stream: RequestStream, accepted: Accepted, ex: _Exchange,
                        timer: RequestTimer) -> web.Response:
    deadline = time.monotonic() + request.app[STATE].config.request_timeout
    parts: list[str] = []
    n = 0
    while True:
        event = await _next_event(request, stream, deadline if n == 0 else None)
        if event is None:
            raise _ClientGone()
        if isinstance(event, Rejected):
            raise _rejected(event)
        parts.append(event.text)
        n += event.n_tokens
        timer.tokens(event.n_tokens)
        if event.finish_reason == "error":
            raise APIError(500, f"generation failed: {event.error}", type="server_error", code="engine_error")
        if event.finish_reason:
            timer.finished(event.finish_reason)
            route = _route_of(stream)
            return web.json_response(ex.body("".join(parts), event.finish_reason, _usage(accepted.prompt_tokens, n),
                                             route), headers={"X-Syshax-Route": route["route"]})


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


async def _respond_stream(request, stream: RequestStream, accepted: Accepted, ex: _Exchange,
                          include_usage: bool, timer: RequestTimer) -> web.StreamResponse:
    # Hold the headers until the first token: an error before it is still a proper HTTP error.
    deadline = time.monotonic() + request.app[STATE].config.request_timeout
    first = await _next_event(request, stream, deadline)
    if first is None:
        raise _ClientGone()
    if isinstance(first, Rejected):
        raise _rejected(first)
    if first.finish_reason == "error":
        raise APIError(500, f"generation failed: {first.error}", type="server_error", code="engine_error")
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no", "X-Syshax-Route": _route_of(stream)["route"]})
    await resp.prepare(request)
    timeout = request.app[STATE].config.client_timeout

    async def send(data: bytes) -> None:
        # a write waits while the client's socket buffers are full: a client that stops reading is let go
        await asyncio.wait_for(resp.write(data), timeout)

    n = 0
    event = first
    try:
        if ex.chat:
            await send(_sse(ex.chunk("", None, role=True)))
        while True:
            n += event.n_tokens
            timer.tokens(event.n_tokens)
            if event.finish_reason == "error":
                err = APIError(500, f"generation failed: {event.error}", type="server_error", code="engine_error")
                await send(_sse(err.body()))
                break
            if event.text:
                await send(_sse(ex.chunk(event.text, None)))
            if event.finish_reason:
                timer.finished(event.finish_reason)
                await send(_sse(ex.final_chunk(event.finish_reason, _route_of(stream))))
                if include_usage:
                    await send(_sse(ex.usage_chunk(_usage(accepted.prompt_tokens, n))))
                break
            event = await _next_event(request, stream, None)
            if event is None:
                return resp
        await send(b"data: [DONE]\n\n")
        await resp.write_eof()
    except (ConnectionResetError, ConnectionError):
        log.info("%s: client disconnected mid-stream after %d tokens", ex.id, n)
    except asyncio.TimeoutError:  # the caller's finally cancels the request and frees its sequence
        log.info("%s: client read nothing of the stream for %gs (client_timeout) after %d tokens; cancelled",
                 ex.id, timeout, n)
        if request.transport is not None:
            request.transport.abort()  # what it has not read goes: it is not reading
    return resp


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


def _model_card(request: web.Request) -> dict:
    return {"id": request.app[MODEL_NAME], "object": "model", "created": int(request.app[STARTED]),
            "owned_by": "syshax"}


@routes.get("/v1/models")
async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model_card(request)]})


@routes.get("/v1/models/{model}")
async def get_model(request: web.Request) -> web.Response:
    name = request.match_info["model"]
    if name != request.app[MODEL_NAME]:
        raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")
    return web.json_response(_model_card(request))


@routes.get("/health")
async def health(request: web.Request) -> web.Response:
    scheduler = request.app[SCHEDULER]
    workers = [{"name": w.name, "state": w.state, "error": w.error or None} for w in scheduler.workers]
    state = request.app[STATE]
    if state.draining:  # a load balancer should stop sending here
        return web.json_response({"status": "draining", "reason": state.drain_reason, "mode": scheduler.mode,
                                  "workers": workers}, status=503)
    if scheduler.is_ready():
        return web.json_response({"status": "ok", "mode": scheduler.mode, "workers": workers})
    failed = any(w.state == "failed" for w in scheduler.workers)
    return web.json_response({"status": "failed" if failed else "loading", "mode": scheduler.mode,
                              "workers": workers}, status=503)


@routes.get("/v1/syshax/status")
async def status(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response(request.app[SCHEDULER].status().to_json() | {
        "draining": state.draining, "http_active": state.active,
        "http_connections": request.app[CONNECTIONS].stats()})


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    body, content_type = request.app[METRICS].render(request.headers.get("Accept"))
    return web.Response(body=body, headers={"Content-Type": content_type})


@routes.get("/openapi.json")
async def openapi(request: web.Request) -> web.Response:
    return web.json_response(request.app[OPENAPI])
