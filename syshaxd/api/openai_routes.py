"""OpenAI's completions and chat completions: one pipeline (parse, tokenize once, run, answer as JSON or SSE) over
each endpoint's shapes (chat_shapes.py, completion_shapes.py). The service endpoints are in service_routes.py."""

from __future__ import annotations

import asyncio
import json
import logging
import time

from aiohttp import web

from syshaxd.api.chat_shapes import ChatExchange
from syshaxd.api.completion_shapes import CompletionExchange
from syshaxd.api.exchange import Exchange
from syshaxd.api.fanout import Fanout
from syshaxd.api.generation import (ClientGone, admitted, engine_failed, next_event, prepared, read_body, rejected,
                                    route_of, run, write_within)
from syshaxd.api.keys import MODEL_NAME, STATE, VOCAB
from syshaxd.api.tools import ToolStream, finish_reason
from syshaxd.api.validate import ParsedRequest, parse_chat, parse_completion
from syshaxd.engine.prompts import Pieces
from syshaxd.metrics import RequestTimer
from syshaxd.sdk.types import Accepted, Rejected

log = logging.getLogger(__name__)
routes = web.RouteTableDef()


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
        exchange = (ChatExchange if chat else CompletionExchange)(parsed, request.app[MODEL_NAME], *views)
        if parsed.stream:
            return await _respond_stream(request, fan, accepted, exchange, parsed.include_usage, timer)
        return await _respond_json(request, fan, accepted, exchange, timer)

    return await run(request, parsed, timer, answer)


async def _respond_json(request, fan: Fanout, accepted: list[Accepted], ex: Exchange,
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


async def _respond_stream(request, fan: Fanout, accepted: list[Accepted], ex: Exchange,
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
        await write_within(resp, data, timeout)

    n = 0
    left = len(ex.choices)
    index, event = first
    held = {ch.index: ToolStream(ex.tools) for ch in ex.choices} if ex.tools is not None else None
    try:
        for chunk in ex.opening_chunks():
            await send(_sse(chunk))
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
            thought, text = ex.read_apart(ch, text, event)  # a reasoning model's thinking goes first, apart
            lp = ex.streamed_logprobs(lp)
            if thought:
                await send(_sse(ex.thought_chunk(ch.index, thought, logprobs=lp)))
                lp = None
            if held is not None:  # text that may be a tool call waits until it is known
                text = held[ch.index].feed(text)
            if text or lp is not None:
                await send(_sse(ex.chunk(ch.index, text, None, logprobs=lp)))
            if event.finish_reason:
                ch.finish = finish = event.finish_reason
                if held is not None:
                    rest, calls = held[ch.index].finish(finish)
                    if rest:
                        await send(_sse(ex.chunk(ch.index, rest, None)))
                    for chunk in ex.tool_call_chunks(ch.index, calls):
                        await send(_sse(chunk))
                    finish = finish_reason(finish, calls)
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
