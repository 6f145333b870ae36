"""The life of every generation request, whichever endpoint it came to: taken or refused while draining, the body
read, the endpoint's translation into one ParsedRequest, each prompt rendered and tokenized once (the capability
check before it), every choice submitted and accepted or none left running, the endpoint's answer, and the
choices freed however it ends.

An endpoint (api/openai/routes.py: chat and completions; api/responses.py; api/messages.py) is an Endpoint:
it parses its body and writes its answer from a Generation, whose Steps (api/core/outputs.py) are the one reading of
the engines' output and whose stream (api/core/sse.py) is the one writer of server-sent events.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Protocol

from aiohttp import web

from syshaxd.api.core import sse
from syshaxd.api.core.app_keys import METRICS, MODEL_NAME, SCHEDULER, STATE, VOCAB
from syshaxd.api.core.errors import APIError, invalid
from syshaxd.api.core.fanout import Fanout
from syshaxd.api.core.long_strings import check_strings
from syshaxd.api.core.outputs import Show, Step, next_event, rejected, steps
from syshaxd.api.core.reasoning import LITERAL_GRAMMAR_FIELDS, after_thinking
from syshaxd.api.core.sse import E, Batch, ClientGone, Framing
from syshaxd.api.core.state import Draining
from syshaxd.api.core.validate import ParsedRequest, parse_json_body
from syshaxd.engine.capabilities import Unsupported
from syshaxd.engine.engine_handle import EngineUnavailable
from syshaxd.engine.scheduler import Overloaded, RouteUnavailable
from syshaxd.metrics import RequestTimer
from syshaxd.sdk.gguf.chat import THINK_OPEN
from syshaxd.sdk.types import Accepted, Delta, GenerateRequest, Rejected, RequestStream

log = logging.getLogger(__name__)


class Endpoint(Protocol):
    """One request to one endpoint: its body as a ParsedRequest, and its answer in its own shapes."""

    def parse(self, body: dict) -> ParsedRequest:
        """The request the body asks for; an APIError names the field."""

    def renamed(self, exc: APIError) -> APIError:
        """An error of the request, named in the endpoint's own fields (the Responses and Messages APIs arrive
        translated into chat's)."""

    async def respond(self, gen: Generation) -> web.StreamResponse:
        """The answer, as JSON or a stream, from the started request."""


@dataclass
class Generation:
    """A started request: every choice accepted, its output to read once and to answer with."""

    request: web.Request
    parsed: ParsedRequest
    fan: Fanout
    accepted: list[Accepted]
    timer: RequestTimer
    deadline: float  # the engine's first token is due by then (request_timeout)

    def steps(self, show: Show | None = None, hold: bool = True) -> AsyncGenerator[Step | None, None]:
        """The output, read once (api/core/outputs.py)."""
        return steps(self.request, self.parsed, self.fan, self.accepted, self.timer, self.deadline, show, hold)

    @property
    def route(self) -> dict:
        return route_of(self.fan.route_stream)

    async def stream(self, events: AsyncIterator[E | Batch], framing: Framing[E]) -> web.StreamResponse:
        """The events as server-sent events (api/core/sse.py)."""
        return await sse.stream(self.request, lambda: self.route["route"], self.parsed.generate.request_id, events,
                                framing)

    def json(self, body: dict) -> web.Response:
        return web.json_response(body, headers={"X-Syshax-Route": self.route["route"]})


async def serve(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    """The endpoint's answer to the request, counted in progress: a drain waits for it, and a draining daemon
    answers 503 instead."""
    timer = request.app[METRICS].request()
    try:
        with request.app[STATE].one_request():
            return await _served(request, endpoint, timer)
    except Draining as exc:
        raise APIError(503, f"syshaxd is draining ({exc}) and takes no new requests; retry shortly or send the "
                       "request to another instance.", type="server_error", code="draining",
                       headers={"Retry-After": "5"}) from None


async def _served(request: web.Request, endpoint: Endpoint, timer: RequestTimer) -> web.StreamResponse:
    body = await read_body(request)
    try:
        _refuse_embedding_model(request, body)
        parsed = await prepared(request, endpoint.parse(body))
        # the first token is due within request_timeout, the engine's accepting the request included: a worker reads
        # it between two steps and answers after the next one, and a step of a big model on CPUs (or of any model
        # under emulation) can take long
        deadline = time.monotonic() + request.app[STATE].config.request_timeout
        try:
            fan, accepted = await _start(request, parsed, deadline)
        except ClientGone:
            return web.Response(status=499, text="client closed the request")
        timer.accepted(sum(a.prompt_tokens for a in accepted[:: parsed.n]))
        try:
            return await endpoint.respond(Generation(request, parsed, fan, accepted, timer, deadline))
        except ClientGone:
            log.info("%s: client left before the answer was ready", parsed.generate.request_id)
            return web.Response(status=499, text="client closed the request")
        finally:
            fan.cancel()  # no-op once finished; frees the sequences if the client left
    except APIError as exc:
        raise endpoint.renamed(exc) from None


def _refuse_embedding_model(request: web.Request, body: dict) -> None:
    """A generation request sent to an embedding model of [[models]]: a 400 that says what to send instead."""
    model = body.get("model")
    entries = request.app[SCHEDULER].entries
    if isinstance(model, str) and model in entries and entries[model].kind == "embedding":
        what = ("a reranker: it scores documents against a query (POST /v1/rerank)"
                if entries[model].kind_name == "reranker"
                else "an embedding model: it makes vectors (POST /v1/embeddings)")
        raise invalid(f"`{model}` is {what}, not text. Send this request to `{request.app[MODEL_NAME]}`.",
                      param="model", code="model_not_supported")


def route_of(stream: RequestStream) -> dict:
    """Where the request ran: "cpu", "gpu" or "hetero"; in auto mode why, and whether its decode moved back."""
    route: dict[str, str] = {"route": str(stream.route)}
    if stream.reason:
        route["reason"] = stream.reason
    if stream.decided_by:
        route["decided_by"] = stream.decided_by
    if stream.moved_to:
        route["moved_to"] = stream.moved_to
    return route


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


def _submit(request: web.Request, generate: GenerateRequest, route: str, fields: dict | None) -> RequestStream:
    with _scheduler_refusals():
        return request.app[SCHEDULER].submit(generate, route, fields)


def rule_fields(parsed: ParsedRequest) -> dict:
    """The request's fields as routing rules read them (routing_rules.py's FIELDS; the scheduler adds
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


async def _accepted(request: web.Request, stream: RequestStream, deadline: float) -> Accepted:
    event = await next_event(request, stream, deadline)
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
    end = (parsed.generate.prompt_tokens or ())[-_PROMPT_END_TOKENS:]
    text = b"".join(holder.pieces.bytes(t) for t in end if 0 <= t < vocab.n_vocab).decode("utf-8", errors="replace")
    assert parsed.thinking is not None  # a chat request's: prepared settles only those
    thinking = parsed.thinking.settle(vocab.template.thinking, text)
    generates = parsed.generates
    if thinking.split and (thinking.opened or len(vocab.tokenize(THINK_OPEN, add_special=False)) == 1):
        generates = tuple(replace(g, grammar=after_thinking(g.grammar, thinking.opened))
                          if g.grammar and g.grammar_field not in LITERAL_GRAMMAR_FIELDS else g for g in generates)
    return replace(parsed, thinking=thinking, generates=generates)


async def _start(request: web.Request, parsed: ParsedRequest, deadline: float) -> tuple[Fanout, list[Accepted]]:
    """Every choice of the prepared request submitted and accepted by `deadline`, or none left running."""
    streams: list[RequestStream] = []
    try:
        for generate in parsed.generates:
            streams.append(_submit(request, generate, parsed.route, parsed.fields))
        accepted = [await _accepted(request, s, deadline) for s in streams]
    except BaseException:
        for s in streams:
            s.cancel()
        raise
    return Fanout(streams), accepted


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


