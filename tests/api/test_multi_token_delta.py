"""An engine step may give a sequence several tokens at once (speculative decoding: one Delta, n_tokens > 1, a token
id and a logprob entry per token). The API's one reading of the output (api/core/outputs.steps) and the chat and
completions shapes count every token of it in the usage and the metrics, show a logprob entry and a text offset per
token, and end the choice on the Delta that carries the finish reason, streamed or not."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from syshaxd.api.core.fanout import Fanout
from syshaxd.api.core.outputs import steps
from syshaxd.api.core.reasoning import ThinkingReader
from syshaxd.api.core.sse import data
from syshaxd.api.core.validate import parse_chat, parse_completion
from syshaxd.api.openai.chat_shapes import ChatExchange
from syshaxd.api.openai.completion_shapes import CompletionExchange
from syshaxd.metrics import Metrics
from syshaxd.sdk.types import Accepted, Delta, Route, TokenLogprob

PIECES = {10: " Paris", 11: " is", 12: " big", 13: ".", 14: " Yes", 15: "!"}


class Pieces:
    def text(self, token: int) -> str:
        return PIECES[token]

    def bytes(self, token: int) -> bytes:
        return PIECES[token].encode()


class Stream:
    """A RequestStream whose engine gave two tokens, then three, then one that ends it."""

    request_id, route, reason, moved_to, decided_by, finished, tokens_sent = "r", Route.CPU, "", "", "", False, 0

    def __init__(self) -> None:
        def delta(tokens, finish=None):
            entries = tuple(TokenLogprob(t, -0.5 * t, ((t, -0.5 * t), (15, -9.0))) for t in tokens)
            return Delta("r", "".join(PIECES[t] for t in tokens), len(tokens), finish, None, tuple(tokens), entries)

        self.events = [delta((10, 11)), delta((12, 13, 14)), delta((15,), "length")]

    async def next_event(self):
        return self.events.pop(0)

    def cancel(self) -> None:
        pass


class Transport:
    def is_closing(self) -> bool:
        return False


class Request:
    transport = Transport()


async def _answer(ex, parsed):
    metrics = Metrics("m", lambda: None)  # type: ignore[arg-type, return-value]
    timer = metrics.request()
    accepted = [Accepted("r", 7, 6)]
    chunks = []
    async for step in steps(Request(), parsed, Fanout([Stream()]), accepted, timer, time.monotonic() + 5, ex.show):
        if step is None:
            continue
        # as a stream writes it (api/openai/routes._chunks), then folded into the JSON body
        if step.logprobs is None and step.text:
            chunk = data(ex.text_chunk(step.index, step.text))
        else:
            chunk = data(ex.chunk(step.index, step.text, step.finish.reason if step.finish else None,
                                  logprobs=ex.streamed_logprobs(step.logprobs)))
        chunks.append(json.loads(chunk[len(b"data: "):]))
        ex.fold(step)
    return ex.body(ex.usage(accepted), {"route": "cpu"}), chunks, metrics.tokens.generated


def test_completions_count_and_show_every_token_of_a_multi_token_delta():
    parsed = parse_completion({"model": "m", "prompt": "x", "max_tokens": 6, "logprobs": 1}, "m")
    body, chunks, counted = asyncio.run(_answer(CompletionExchange(parsed, "m", Pieces(), [], None), parsed))
    choice = body["choices"][0]
    assert choice["text"] == " Paris is big. Yes!" and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 6 == counted
    lp = choice["logprobs"]
    assert lp["tokens"] == [" Paris", " is", " big", ".", " Yes", "!"]
    assert lp["token_logprobs"] == [-5.0, -5.5, -6.0, -6.5, -7.0, -7.5]
    assert lp["text_offset"] == [0, 6, 9, 13, 14, 18]
    assert [c["choices"][0]["text"] for c in chunks] == [" Paris is", " big. Yes", "!"]
    assert [len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks] == [2, 3, 1]


@pytest.mark.parametrize("logprobs", [False, True])
def test_chat_counts_and_shows_every_token_of_a_multi_token_delta(logprobs):
    parsed = parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
                         "logprobs": logprobs, "stream": True}, "m")
    body, chunks, counted = asyncio.run(_answer(ChatExchange(parsed, "m", Pieces(), [], None), parsed))
    choice = body["choices"][0]
    assert choice["message"]["content"] == " Paris is big. Yes!" and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 6 == counted
    assert [c["choices"][0]["delta"]["content"] for c in chunks] == [" Paris is", " big. Yes", "!"]
    if logprobs:
        assert [e["token"] for e in choice["logprobs"]["content"]] == [" Paris", " is", " big", ".", " Yes", "!"]
        assert [len(c["choices"][0]["logprobs"]["content"]) for c in chunks] == [2, 3, 1]


def test_a_multi_token_delta_that_ends_the_thinking_counts_only_the_thinking_tokens_as_reasoning():
    """A decode step that kept guesses may give the end of the thinking and the answer's first tokens in one Delta:
    reasoning_tokens counts the tokens up to and with the one that closed the thinking, as one token per Delta
    counts them."""
    pieces = ["<think>", "a", " b", "</think>", " c", " d"]
    reader = ThinkingReader(False)
    assert reader.feed("".join(pieces), 6, False, pieces) == ("a b", "c d")
    assert reader.tokens == 4
    one_by_one = ThinkingReader(False)
    parts = [one_by_one.feed(p, 1, False) for p in pieces]
    assert ("".join(t for t, _ in parts), "".join(a for _, a in parts)) == ("a b", "c d")
    assert one_by_one.tokens == 4
    # pieces that do not make up the text (a character split between two tokens): the event counts whole
    whole = ThinkingReader(False)
    assert whole.feed("<think>é</think> c", 3, False, ["<think>", "\ufffd", "\ufffd</think> c"]) == ("é", "c")
    assert whole.tokens == 3
