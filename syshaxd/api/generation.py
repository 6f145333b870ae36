"""The generation core every endpoint shares: admit, read the body, submit, read events back, stream them out.

Chat and completions (api/openai_routes.py), the Responses API (api/responses.py) and the
Messages API (api/messages.py) differ only in the shapes they parse and write; the life of a
request between those shapes lives here once: draining and admission, the body read within
client_timeout, every choice submitted and accepted or none left running, a client that leaves
noticed while we wait, and the route note.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

from aiohttp import web

from syshaxd.api.errors import APIError
from syshaxd.api.fanout import Fanout
from syshaxd.api.keys import METRICS, SCHEDULER, STATE, VOCAB
from syshaxd.api.long_strings import check_strings
from syshaxd.api.reasoning import LITERAL_GRAMMAR_FIELDS, ThinkingReader, after_thinking
from syshaxd.api.state import Draining
from syshaxd.api.tools import ToolCall, ToolStream
from syshaxd.api.validate import ParsedRequest, parse_json_body
from syshaxd.engine.capabilities import Unsupported
from syshaxd.engine.scheduler import Overloaded, RouteUnavailable
from syshaxd.engine.supervisor import EngineUnavailable
from syshaxd.sdk.gguf.chat import THINK_OPEN
from syshaxd.sdk.types import Accepted, Delta, GenerateRequest, Refusal, Rejected, RequestStream
from syshaxd.metrics import RequestTimer

log = logging.getLogger(__name__)

_DISCONNECT_POLL = 1.0  # seconds between checks that a waiting client is still there


class ClientGone(Exception):
    """The client closed the connection while we waited; nobody is left to answer."""


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def next_event(request: web.Request, stream, deadline: float | None):
    """The stream's next event; None if the client left. Raises APIError past the deadline."""
    while True:
        timeout = _DISCONNECT_POLL
        if deadline is not None:
            timeout = min(timeout, max(deadline - time.monotonic(), 0.0))
        try:
            async with asyncio.timeout(timeout):  # no task per call, as wait_for would make: this runs per token
                return await stream.next_event()
        except asyncio.TimeoutError:
            if _client_gone(request):
                return None
            if deadline is not None and time.monotonic() >= deadline:
                raise APIError(503, "The request waited too long for the engine (request_timeout); retry later.",
                               type="server_error", code="timeout") from None


def route_of(stream: RequestStream) -> dict:
    """Where the request ran: "cpu", "gpu" or "hetero"; in auto mode why, and whether its decode moved back."""
    route = {"route": stream.route}
    if stream.reason:
        route["reason"] = stream.reason
    if stream.decided_by:
        route["decided_by"] = stream.decided_by
    if stream.moved_to:
        route["moved_to"] = stream.moved_to
    return route


REFUSAL_STATUS = {Refusal.INVALID: 400, Refusal.UNAVAILABLE: 503, Refusal.FAILED: 500}


def rejected(event: Rejected) -> APIError:
    kind = "invalid_request_error" if event.kind == Refusal.INVALID else "server_error"
    # the worker is being replaced; one given up on (engine_failed) will not be back by retrying
    retry = event.kind == Refusal.UNAVAILABLE and event.code != "engine_failed"
    return APIError(REFUSAL_STATUS[event.kind], event.message, type=kind, param=event.param, code=event.code,
                    headers={"Retry-After": "1"} if retry else None)


def engine_failed(event: Delta) -> APIError:
    return APIError(500, f"generation failed: {event.error}", type="server_error", code="engine_error")


@contextmanager
def _scheduler_refusals() -> Iterator[None]:
    """The scheduler's refusals as the API's errors."""
    try:
        yield
    except Overloaded as exc:
        raise APIError(429, str(exc), type="rate_limit_error", code="rate_limit_exceeded",
                       headers={"Retry-After": str(exc.retry_after)}) from None
    except RouteUnavailable as exc:
        raise APIError(400, str(exc), param="syshax.mode", code="unsupported_route") from None
    except Unsupported as exc:
        raise APIError(400, str(exc), param=exc.param, code="unsupported_parameter") from None
    except EngineUnavailable as exc:
        raise APIError(503, str(exc), type="server_error", code="engine_unavailable",
                       headers=None if exc.final else {"Retry-After": "5"}) from None


def _submit(request: web.Request, generate: GenerateRequest, route: str, fields: dict) -> RequestStream:
    with _scheduler_refusals():
        return request.app[SCHEDULER].submit(generate, route, fields)


def rule_fields(parsed: ParsedRequest) -> dict:
    """The request's fields as routing rules read them (engine/routing_rules.py's FIELDS; the scheduler adds
    prompt_tokens): what the client set, in chat's terms (the Responses and Messages APIs arrive translated); a field
    it did not set is absent, so that only `exists = false` holds for it."""
    g = parsed.generate
    s = g.sampling
    fields = {"model": parsed.model, "stream": parsed.stream, "n": parsed.n, "max_tokens": g.max_tokens,
              "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "seed": s.seed,
              "presence_penalty": s.presence_penalty, "frequency_penalty": s.frequency_penalty,
              "messages": list(g.messages) if g.messages is not None else None,
              "tools": list(g.tools) if g.tools else None, "stop": list(g.stop) if g.stop else None}
    return {k: v for k, v in fields.items() if v is not None}


async def _accepted(request: web.Request, stream: RequestStream) -> Accepted:
    event = await next_event(request, stream, time.monotonic() + 30.0)
    if event is None:
        raise ClientGone()
    if isinstance(event, Rejected):
        raise rejected(event)
    if isinstance(event, Delta):  # the worker died before it could accept
        raise APIError(503, event.error or "the engine failed", type="server_error", code="engine_error")
    return event


async def prepared(request: web.Request, parsed: ParsedRequest) -> ParsedRequest:
    """parsed with each prompt rendered and tokenized once, for every choice of it (the engines get token ids), and a
    chat request's thinking settled (how a reasoning model's output is read); a 400 when a prompt cannot run. Once is
    enough: a tokenized prompt is not tokenized again."""
    scheduler = request.app[SCHEDULER]
    with _scheduler_refusals():  # no tokenizing for a request that no engine can take (its choices ask alike)
        scheduler.check_capabilities(parsed.generate, parsed.route)
    fields = parsed.fields if parsed.fields is not None else rule_fields(parsed)  # messages are still messages here
    choices = await scheduler.prepare(parsed.generates, parsed.n)
    if isinstance(choices, Rejected):
        raise rejected(choices)
    parsed = replace(parsed, generates=tuple(choices), fields=fields)
    if parsed.thinking is not None and not parsed.thinking.settled:
        parsed = await _thinking_settled(request, parsed)
    return parsed


# tokens at the end of a rendered prompt read for an open <think>: the generation prompt's few ("<think>\n")
_PROMPT_END_TOKENS = 32


async def _thinking_settled(request: web.Request, parsed: ParsedRequest) -> ParsedRequest:
    """parsed with its thinking settled from the model's template and the end of its rendered prompt (a chat request
    has one prompt), and, where its output is read apart, a grammar the daemon built (a schema, a forced call) moved
    after the thinking. llama-server's `grammar` stays as sent: there it holds the whole output.

    Where the prompt leaves the thinking to the model, the grammar lets it open a block only if `<think>` is one
    token of its vocabulary (Qwen3's, DeepSeek's): a model that spells it out would be steered into thinking by any
    first "<" (measured: SmolLM2 with Qwen3's template, asked for a forced call, began "<tool_call>" and was made
    to think to max_tokens)."""
    holder = request.app[VOCAB]
    vocab = await holder.get()
    end = parsed.generate.prompt_tokens[-_PROMPT_END_TOKENS:]
    text = b"".join(holder.pieces.bytes(t) for t in end if 0 <= t < vocab.n_vocab).decode("utf-8", errors="replace")
    thinking = parsed.thinking.settle(vocab.template.thinking, text)
    generates = parsed.generates
    if thinking.split and (thinking.opened or len(vocab.tokenize(THINK_OPEN, add_special=False)) == 1):
        generates = tuple(replace(g, grammar=after_thinking(g.grammar, thinking.opened))
                          if g.grammar and g.grammar_field not in LITERAL_GRAMMAR_FIELDS else g for g in generates)
    return replace(parsed, thinking=thinking, generates=generates)


async def start(request: web.Request, parsed: ParsedRequest) -> tuple[Fanout, list[Accepted]]:
    """Every choice submitted and accepted, or none left running."""
    streams: list[RequestStream] = []
    parsed = await prepared(request, parsed)
    try:
        for generate in parsed.generates:
            streams.append(_submit(request, generate, parsed.route, parsed.fields))
        accepted = [await _accepted(request, s) for s in streams]
    except BaseException:
        for s in streams:
            s.cancel()
        raise
    return Fanout(streams), accepted


async def admitted(request: web.Request, handler: Callable[[RequestTimer], Awaitable[web.StreamResponse]]
                   ) -> web.StreamResponse:
    """handler(timer), counted as admitted: a drain waits for it, and a draining daemon answers 503 instead."""
    timer = request.app[METRICS].request()
    try:
        with request.app[STATE].admitted():
            return await handler(timer)
    except Draining as exc:
        raise APIError(503, f"syshaxd is draining ({exc}) and takes no new requests; retry shortly or send the "
                       "request to another instance.", type="server_error", code="draining",
                       headers={"Retry-After": "5"}) from None


async def read_body(request: web.Request) -> dict:
    """The JSON object the client sent, whole within client_timeout, each string within max_string_bytes."""
    cfg = request.app[STATE].config
    try:
        raw = await asyncio.wait_for(request.read(), cfg.client_timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"The request body did not arrive within {cfg.client_timeout:g}s (client_timeout); "
                       "send the whole body at once.", code="request_timeout",
                       headers={"Connection": "close"}) from None
    body = parse_json_body(raw)
    check_strings(body, len(raw), cfg.max_string_bytes)
    return body


async def run(request: web.Request, parsed: ParsedRequest, timer: RequestTimer,
              answer: Callable[[Fanout, list[Accepted]], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """Start the request's choices and answer(fan, accepted); the choices are freed however it ends."""
    try:
        fan, accepted = await start(request, parsed)
    except ClientGone:
        return web.Response(status=499, text="client closed the request")
    timer.accepted(sum(a.prompt_tokens for a in accepted[:: parsed.n]))
    try:
        return await answer(fan, accepted)
    except ClientGone:
        log.info("%s: client left before the answer was ready", parsed.generate.request_id)
        return web.Response(status=499, text="client closed the request")
    finally:
        fan.cancel()  # no-op once finished; frees the sequences if the client left


# --- one choice read as text and a finish (the Responses and Messages APIs) ----------------------------


@dataclass(frozen=True)
class Finish:
    """How one choice ended: the finish reason, the tool calls read from its output, the token counts, and the
    token ids generated (where the engine reports them)."""

    reason: str  # "stop" or "length"
    calls: list[ToolCall]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    tokens: tuple[int, ...] = ()
    reasoning_tokens: int = 0  # of completion_tokens, those up to the end of the thinking

    @property
    def whole_calls(self) -> bool:
        """The output is tool calls, none of them cut short by max_tokens."""
        return bool(self.calls) and all(c.complete for c in self.calls)


@dataclass(frozen=True)
class Thought:
    """A piece of a reasoning model's thinking, read apart from its answer (api/reasoning.py)."""

    text: str


async def turn(request: web.Request, parsed: ParsedRequest, fan: Fanout, accepted: list[Accepted],
               timer: RequestTimer) -> AsyncIterator[str | Thought | Finish | None]:
    """A one-choice request's output as an endpoint writes it, item by item.

    First None, once the engine's first event arrived: a stream may send its headers now (an error before
    it is still an APIError the handler answers with an HTTP status). Then, for a reasoning model whose output
    is read apart, its thinking in non-empty Thoughts; then the text, in non-empty pieces as
    they may go out (with tools, text that may be a call is held until the output is complete: api/tools.py),
    or one empty text when the answer has neither thinking, text nor a call; last one Finish. ClientGone when
    the client left.
    """
    deadline = time.monotonic() + request.app[STATE].config.request_timeout
    held = ToolStream(parsed.tools) if parsed.tools is not None else None
    thinking = parsed.thinking
    reader = ThinkingReader(thinking.opened) if thinking is not None and thinking.split else None
    n = 0
    started = shown = False
    ids: list[int] = []
    while True:
        got = await next_event(request, fan, deadline if n == 0 else None)
        if got is None:
            raise ClientGone()
        event = got[1]
        if isinstance(event, Rejected):
            raise rejected(event)
        if event.finish_reason == "error":
            raise engine_failed(event)
        if not started:
            started = True
            yield None
        n += event.n_tokens
        ids += event.tokens
        timer.tokens(event.n_tokens)
        text = event.text
        if reader is not None:
            thought, text = reader.feed(text, event.n_tokens, event.finish_reason is not None)
            if thought:
                shown = True
                yield Thought(thought)
        text = held.feed(text) if held is not None else text
        calls = []
        if event.finish_reason and held is not None:
            rest, calls = held.finish(event.finish_reason)
            text += rest
        if text or (event.finish_reason and not shown and not calls):
            shown = True
            yield text
        if event.finish_reason:
            timer.finished(event.finish_reason)
            yield Finish(event.finish_reason, calls, accepted[0].prompt_tokens, n, accepted[0].cached_tokens,
                         tuple(ids), reader.tokens if reader is not None else 0)
            return


async def typed_sse(events: AsyncIterator[dict], failed: Callable[[APIError, int], dict]) -> AsyncIterator[bytes]:
    """Typed events as SSE (`event: <type>` and the event as data). A failure before the first event is the
    caller's HTTP error; after it, the stream ends with failed(error, events sent)."""
    sent = 0
    try:
        async for event in events:
            sent += 1
            yield _typed(event)
    except APIError as exc:
        if not sent:
            raise
        yield _typed(failed(exc, sent))


def _typed(event: dict) -> bytes:
    return f"event: {event['type']}\ndata: ".encode() + json.dumps(event, ensure_ascii=False).encode() + b"\n\n"


async def write_within(resp: web.StreamResponse, data: bytes, timeout: float) -> None:
    """resp.write(data), given up with TimeoutError after `timeout` seconds (a client that stops reading). Unlike
    asyncio.wait_for it makes no task per write: a stream writes once per token."""
    async with asyncio.timeout(timeout):
        await resp.write(data)


async def stream_sse(request: web.Request, fan: Fanout, request_id: str,
                     events: AsyncIterator[bytes]) -> web.StreamResponse:
    """Server-sent events from `events`. The headers wait for its first event (an error before it is a proper
    HTTP error); a client that leaves or stops reading for client_timeout ends the stream."""
    first = await anext(events)
    route = route_of(fan.route_stream)["route"]
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no", "X-Syshax-Route": route})
    await resp.prepare(request)
    timeout = request.app[STATE].config.client_timeout
    try:
        await write_within(resp, first, timeout)
        async for data in events:
            # a write waits while the client's socket buffers are full: a client that stops reading is let go
            await write_within(resp, data, timeout)
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
        await events.aclose()
    return resp
