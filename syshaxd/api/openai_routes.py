"""The OpenAI-compatible endpoints: completions, chat completions (JSON or SSE), models, health, metrics, OpenAPI."""

from __future__ import annotations

import asyncio
import json
import logging
import time

from aiohttp import web

from syshaxd import __version__
from syshaxd.api.errors import APIError
from syshaxd.api import logprob_shapes
from syshaxd.api.fanout import Fanout
from syshaxd.api.generation import (ClientGone, admitted, engine_failed, next_event, prepared, read_body, rejected,
                                    route_of, run)
from syshaxd.api.keys import CONNECTIONS, METRICS, MODEL_NAME, OPENAPI, SCHEDULER, STARTED, STATE, VOCAB
from syshaxd.api.tools import ToolStream, parse_output
from syshaxd.engine.prompts import Pieces
from syshaxd.api.validate import ParsedRequest, parse_chat, parse_completion
from syshaxd.engine.types import Accepted, Delta, Rejected
from syshaxd.metrics import RequestTimer

log = logging.getLogger(__name__)
routes = web.RouteTableDef()

SYSTEM_FINGERPRINT = f"syshax-{__version__}"


class _Choice:
    """What one choice has shown so far."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.parts: list[str] = []
        self.n = 0  # tokens generated
        self.finish: str | None = None
        self.logprobs: dict | None = None
        self.chars = 0  # characters shown: where the next token's text_offset begins
        self.started = False


class _Exchange:
    """The shapes of one endpoint's bodies and stream chunks, for every choice of the request."""

    def __init__(self, chat: bool, parsed: ParsedRequest, model: str, pieces: Pieces | None,
                 echo_texts: list[str], prompt_ids: list[list[int]] | None) -> None:
        self.chat = chat
        self.parsed = parsed
        self.id = parsed.generate.request_id
        self.created = int(time.time())
        self.model = model
        self.object = "chat.completion" if chat else "text_completion"
        self.pieces = pieces
        self.echo_texts = echo_texts  # per prompt: what echo puts before the completion
        self.prompt_ids = prompt_ids  # per prompt: its tokens, for echo's prompt logprobs
        self.choices = [_Choice(i) for i in range(len(parsed.generates))]
        self.tools = parsed.tools  # chat with tools: the output is read back into tool calls

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": SYSTEM_FINGERPRINT}

    def shown(self, ch: _Choice, event: Delta) -> tuple[str, dict | None]:
        """The text and logprobs one Delta of a choice adds to the answer (echo's prompt comes with the first)."""
        parsed = self.parsed
        text, entries = event.text, list(event.logprobs)
        if parsed.max_tokens_zero:  # the one token the engine had to generate is not shown
            text, entries = "", []
        prefix, prompt_part = "", None
        if not ch.started:
            ch.started = True
            p = parsed.prompt_index(ch.index)
            if parsed.echo:
                prefix = self.echo_texts[p]
                if parsed.logprobs and event.prompt_logprobs is not None:
                    prompt_part = logprob_shapes.completion(list(event.prompt_logprobs), self.prompt_ids[p],
                                                            self.pieces, 0)
        lp = None
        if parsed.logprobs:
            if self.chat:
                lp = logprob_shapes.chat(entries, self.pieces)
            else:
                lp = logprob_shapes.completion(entries, [e.token for e in entries], self.pieces,
                                               ch.chars + len(prefix))
                if prompt_part is not None:
                    lp = logprob_shapes.extend(prompt_part, lp)
        text = prefix + text
        ch.chars += len(text)
        return text, lp

    def add(self, ch: _Choice, event: Delta) -> None:
        """Keep a Delta's output for the whole body."""
        text, lp = self.shown(ch, event)
        ch.parts.append(text)
        ch.n += event.n_tokens
        if lp is not None:
            if ch.logprobs is None:
                ch.logprobs = lp
            elif self.chat:
                ch.logprobs["content"] += lp["content"]
            else:
                logprob_shapes.extend(ch.logprobs, lp)

    def usage(self, accepted: list[Accepted]) -> dict:
        """Each prompt counted once (its n choices share it), every choice's completion counted."""
        firsts = accepted[:: self.parsed.n]
        prompt = sum(a.prompt_tokens for a in firsts)
        completion = 0 if self.parsed.max_tokens_zero else sum(ch.n for ch in self.choices)
        return _usage(prompt, completion, sum(a.cached_tokens for a in firsts))

    def body(self, usage: dict, route: dict) -> dict:
        choices = []
        for ch in self.choices:
            text = "".join(ch.parts)
            if self.chat:
                message, finish = {"role": "assistant", "content": text}, ch.finish
                if self.tools is not None:
                    content, calls = parse_output(text, self.tools)
                    if calls:
                        message = {"role": "assistant", "content": content,
                                   "tool_calls": [c.to_json() for c in calls]}
                        finish = "tool_calls"
                choices.append({"index": ch.index, "message": message, "logprobs": ch.logprobs,
                                "finish_reason": finish})
            else:
                choices.append({"index": ch.index, "text": text, "logprobs": ch.logprobs,
                                "finish_reason": ch.finish})
        return self._head(self.object) | {"choices": choices, "usage": usage, "syshax": route}

    def chunk(self, index: int, text: str | None, finish: str | None, role: bool = False,
              logprobs: dict | None = None) -> dict:
        if self.chat:
            delta: dict = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            return self._head("chat.completion.chunk") | {"choices": [choice]}
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        return self._head("text_completion") | {"choices": [choice]}

    def tool_call_chunks(self, index: int, calls: list) -> list[dict]:
        """A choice's calls as OpenAI streams them: id, type and name first, then the arguments."""
        chunks = []
        for i, call in enumerate(calls):
            for part in (call.to_json(i) | {"function": {"name": call.name, "arguments": ""}},
                         {"index": i, "function": {"arguments": call.arguments}}):
                choice = {"index": index, "delta": {"tool_calls": [part]}, "logprobs": None, "finish_reason": None}
                chunks.append(self._head("chat.completion.chunk") | {"choices": [choice]})
        return chunks

    def final_chunk(self, index: int, finish: str, route: dict) -> dict:
        """The chunk with a choice's finish reason, and syshax's note of the route the request took."""
        return self.chunk(index, None if self.chat else "", finish) | {"syshax": route}

    def usage_chunk(self, usage: dict) -> dict:
        return self._head("chat.completion.chunk" if self.chat else "text_completion") | {
            "choices": [], "usage": usage}


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            # prompt tokens whose KV came from the prefix cache
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


async def _prompt_views(request: web.Request, parsed: ParsedRequest) -> tuple[Pieces | None, list[str], list | None]:
    """What echo and logprobs show of the prompts: the token pieces, each prompt's text, and its token ids."""
    if not (parsed.echo or parsed.logprobs):
        return None, [], None
    holder = request.app[VOCAB]
    vocab = await holder.get()
    firsts = parsed.generates[:: parsed.n]  # one per prompt, tokenized (generation.prepared)
    ids = [list(g.prompt_tokens) for g in firsts] if parsed.echo and parsed.logprobs else None
    texts = []
    for g, text in zip(firsts, parsed.prompts):
        if text is None and g.prompt_tokens is not None:
            text = b"".join(holder.pieces.bytes(t) for t in g.prompt_tokens if 0 <= t < vocab.n_vocab).decode(
                "utf-8", errors="replace")
        texts.append(text or "")
    return holder.pieces, texts, ids


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    return await admitted(request, lambda timer: _generate_admitted(request, chat, timer))


async def _generate_admitted(request: web.Request, chat: bool, timer: RequestTimer) -> web.StreamResponse:
    cfg = request.app[STATE].config
    body = await read_body(request)
    parsed = (parse_chat(body, request.app[MODEL_NAME], cfg.default_max_tokens, cfg.max_messages) if chat
              else parse_completion(body, request.app[MODEL_NAME], cfg.default_max_tokens))
    parsed = await prepared(request, parsed)  # each prompt tokenized once, for its choices and its echo
    views = await _prompt_views(request, parsed)

    async def answer(fan: Fanout, accepted: list[Accepted]) -> web.StreamResponse:
        exchange = _Exchange(chat, parsed, request.app[MODEL_NAME], *views)
        if parsed.stream:
            return await _respond_stream(request, fan, accepted, exchange, parsed.include_usage, timer)
        return await _respond_json(request, fan, accepted, exchange, timer)

    return await run(request, parsed, timer, answer)


async def _respond_json(request, fan: Fanout, accepted: list[Accepted], ex: _Exchange,
                        timer: RequestTimer) -> web.Response:
    deadline = time.monotonic() + request.app[STATE].config.request_timeout
    left = len(ex.choices)
    n = 0
    while left:
        got = await next_event(request, fan, deadline if n == 0 else None)
        if got is None:
            raise ClientGone()
        index, event = got
        if isinstance(event, Rejected):
            raise rejected(event)
        ch = ex.choices[index]
        ex.add(ch, event)
        n += event.n_tokens
        timer.tokens(event.n_tokens)
        if event.finish_reason == "error":
            raise engine_failed(event)
        if event.finish_reason:
            ch.finish = event.finish_reason
            left -= 1
    timer.finished(ex.choices[-1].finish)
    route = route_of(fan.route_stream)
    return web.json_response(ex.body(ex.usage(accepted), route), headers={"X-Syshax-Route": route["route"]})


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


async def _respond_stream(request, fan: Fanout, accepted: list[Accepted], ex: _Exchange,
                          include_usage: bool, timer: RequestTimer) -> web.StreamResponse:
    # Hold the headers until the first token: an error before it is still a proper HTTP error.
    deadline = time.monotonic() + request.app[STATE].config.request_timeout
    first = await next_event(request, fan, deadline)
    if first is None:
        raise ClientGone()
    if isinstance(first[1], Rejected):
        raise rejected(first[1])
    if first[1].finish_reason == "error":
        raise engine_failed(first[1])
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no",
                                       "X-Syshax-Route": route_of(fan.route_stream)["route"]})
    await resp.prepare(request)
    timeout = request.app[STATE].config.client_timeout

    async def send(data: bytes) -> None:
        # a write waits while the client's socket buffers are full: a client that stops reading is let go
        await asyncio.wait_for(resp.write(data), timeout)

    n = 0
    left = len(ex.choices)
    index, event = first
    held = {ch.index: ToolStream(ex.tools) for ch in ex.choices} if ex.tools is not None else None
    try:
        if ex.chat:
            for ch in ex.choices:
                await send(_sse(ex.chunk(ch.index, "", None, role=True)))
        while True:
            if isinstance(event, Rejected):  # a later choice refused after the headers went out
                await send(_sse(rejected(event).body()))
                break
            ch = ex.choices[index]
            n += event.n_tokens
            ch.n += event.n_tokens
            timer.tokens(event.n_tokens)
            if event.finish_reason == "error":
                err = engine_failed(event)
                await send(_sse(err.body()))
                break
            text, lp = ex.shown(ch, event)
            if held is not None:  # text that may be a tool call waits until it is known
                text = held[ch.index].feed(text)
            if lp is not None and ex.chat and not lp["content"]:
                lp = None
            if text or lp is not None:
                await send(_sse(ex.chunk(ch.index, text, None, logprobs=lp)))
            if event.finish_reason:
                ch.finish = finish = event.finish_reason
                if held is not None:
                    rest, calls = held[ch.index].finish()
                    if rest:
                        await send(_sse(ex.chunk(ch.index, rest, None)))
                    for chunk in ex.tool_call_chunks(ch.index, calls):
                        await send(_sse(chunk))
                    finish = "tool_calls" if calls else finish
                left -= 1
                await send(_sse(ex.final_chunk(ch.index, finish, route_of(fan.route_stream))))
                if not left:
                    timer.finished(event.finish_reason)
                    if include_usage:
                        await send(_sse(ex.usage_chunk(ex.usage(accepted))))
                    break
            got = await next_event(request, fan, None)
            if got is None:
                return resp
            index, event = got
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
