"""OpenAI's completions and chat completions: each request parsed (validate.py) and answered in its endpoint's shapes
(chat_shapes.py, completion_shapes.py), as JSON or chunk by chunk; its life between the two is generation.py's. The
service endpoints are in service_routes.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

from aiohttp import web

from syshaxd.api.core import sse
from syshaxd.api.core.app_keys import MODEL_NAME, STATE, VOCAB
from syshaxd.api.core.errors import APIError
from syshaxd.api.core.generation import Generation, serve
from syshaxd.api.core.tools import finish_reason
from syshaxd.api.core.validate import ParsedRequest, parse_chat, parse_completion
from syshaxd.api.openai.answers import Exchange
from syshaxd.api.openai.chat_shapes import ChatExchange
from syshaxd.api.openai.completion_shapes import CompletionExchange
from syshaxd.engine.prompts import Pieces

routes = web.RouteTableDef()


async def _prompt_views(request: web.Request, parsed: ParsedRequest) -> tuple[Pieces, list[str], list | None]:
    """What echo and logprobs show of the prompts: the token pieces, each prompt's text, and its token ids."""
    holder = request.app[VOCAB]
    vocab = await holder.get()  # loaded already: the prompts were tokenized with it
    if not (parsed.echo or parsed.logprobs):
        return holder.pieces, [], None
    firsts = parsed.generates[:: parsed.n]  # one per prompt, tokenized (generation.prepared)
    ids = [list(g.prompt_tokens or ()) for g in firsts] if parsed.echo and parsed.logprobs else None
    texts = []
    for g, text in zip(firsts, parsed.prompts):
        if text is None and g.prompt_tokens is not None:
            text = b"".join(holder.pieces.bytes(t) for t in g.prompt_tokens if 0 <= t < vocab.n_vocab).decode(
                "utf-8", errors="replace")
        texts.append(text or "")
    return holder.pieces, texts, ids


class _OpenAI:
    """A chat or completions request (generation.Endpoint)."""

    def __init__(self, request: web.Request, chat: bool) -> None:
        self.request = request
        self.chat = chat

    def parse(self, body: dict) -> ParsedRequest:
        cfg = self.request.app[STATE].config
        model = self.request.app[MODEL_NAME]
        if self.chat:
            return parse_chat(body, model, cfg.max_messages)
        return parse_completion(body, model)

    def renamed(self, exc: APIError) -> APIError:
        return exc

    async def respond(self, gen: Generation) -> web.StreamResponse:
        views = await _prompt_views(self.request, gen.parsed)
        ex = (ChatExchange if self.chat else CompletionExchange)(gen.parsed, self.request.app[MODEL_NAME], *views)
        if gen.parsed.stream:
            return await gen.stream(_chunks(gen, ex), sse.OPENAI)
        # the whole text of each choice: chat reads its tool calls from it (chat_shapes.py), nothing is held
        async with aclosing(gen.steps(ex.show, hold=False)) as steps:
            async for step in steps:
                if step is not None:
                    ex.fold(step)
        return gen.json(ex.body(ex.usage(gen.accepted), gen.route))


async def _chunks(gen: Generation, ex: Exchange) -> AsyncIterator[dict | bytes | sse.Batch]:
    """The stream's chunks: each choice's thinking, text and logprobs as they come, its calls and finish reason
    when it ends, and the usage after the last. What a choice's last event adds (its last text, calls and finish,
    and after the last choice the usage, with the stream's end) goes out in one write: a Batch."""
    async with aclosing(gen.steps(ex.show)) as steps:
        await anext(steps)  # the engine's first event: the headers go with the first chunk
        for chunk in ex.opening_chunks():
            yield chunk
        async for step in steps:
            if step is None:
                continue  # outputs.steps' first: the headers may go
            lp = ex.streamed_logprobs(step.logprobs)
            if step.finish is None and not step.thought and lp is None:  # a token's text: most events of a stream
                if step.text:
                    yield ex.text_chunk(step.index, step.text)
                continue
            batch = sse.Batch(last=step.last)  # a choice's end, thinking, logprobs: one write
            if step.thought:  # a reasoning model's thinking goes first, apart
                batch.append(ex.thought_chunk(step.index, step.thought, logprobs=lp))
                lp = None
            if lp is not None:
                batch.append(ex.chunk(step.index, step.text, None, logprobs=lp))
            elif step.text:
                batch.append(ex.text_chunk(step.index, step.text))
            if step.finish is not None:
                ex.ended(step)
                finish = step.finish.reason
                if isinstance(ex, ChatExchange) and ex.tools is not None:  # the held text's calls are known now
                    if step.finish.rest:
                        batch.append(ex.chunk(step.index, step.finish.rest, None))
                    batch += ex.tool_call_chunks(step.index, step.finish.calls)
                    finish = finish_reason(finish, step.finish.calls)
                batch.append(ex.final_chunk(step.index, finish, gen.route))
                if step.last and gen.parsed.include_usage:
                    batch.append(ex.usage_chunk(ex.usage(gen.accepted)))
            if batch:
                yield batch


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    return await serve(request, _OpenAI(request, chat=False))


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await serve(request, _OpenAI(request, chat=True))
