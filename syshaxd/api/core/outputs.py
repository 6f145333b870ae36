"""A started request's output, read back from the engines once for every endpoint: each event of each choice as
one Step, with a reasoning model's thinking read apart and, where the output may be a tool call, the text that
could be one held until it is known.

Here, and only here: the wait for the engine's first event within request_timeout, a client that leaves
while we wait, a choice the engine refused or failed (an APIError; before the first Step, the endpoint's
HTTP error), and the token counts the request's timer keeps. Each endpoint only writes Steps in its own
shapes (openai/routes.py, responses.py, messages.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

from aiohttp import web

from syshaxd.api.core.app_keys import VOCAB
from syshaxd.api.core.errors import APIError
from syshaxd.api.core.fanout import Fanout
from syshaxd.api.core.reasoning import ThinkingReader
from syshaxd.api.core.sse import ClientGone
from syshaxd.api.core.tools import ToolCall, ToolStream
from syshaxd.api.core.validate import ParsedRequest
from syshaxd.metrics import RequestTimer
from syshaxd.sdk.types import Accepted, Delta, Refusal, Rejected, RequestStream

_DISCONNECT_POLL = 1.0  # seconds between checks that a waiting client is still there


def client_gone(request: web.Request) -> bool:
    """Whether the client closed its connection (or it broke): what it asked for need not go on."""
    transport = request.transport
    return transport is None or transport.is_closing()


async def next_event(request: web.Request, stream: Fanout | RequestStream, deadline: float | None):
    """The stream's next event; None if the client left. Raises APIError past the deadline."""
    while True:
        if client_gone(request):  # looked at each event too: tokens that keep coming must not hide a client that
            return None            # left an answer without a stream, which would then be generated to its end
        timeout = _DISCONNECT_POLL
        if deadline is not None:
            timeout = min(timeout, max(deadline - time.monotonic(), 0.0))
        try:
            async with asyncio.timeout(timeout):  # no task per call, as wait_for would make: this runs per token
                return await stream.next_event()
        except asyncio.TimeoutError:
            if client_gone(request):
                return None
            if deadline is not None and time.monotonic() >= deadline:
                raise APIError(503, "The request waited too long for the engine (request_timeout); retry later.",
                               type="server_error", code="timeout") from None


REFUSAL_STATUS = {Refusal.INVALID: 400, Refusal.UNAVAILABLE: 503, Refusal.FAILED: 500}


def rejected(event: Rejected) -> APIError:
    kind = "invalid_request_error" if event.kind == Refusal.INVALID else "server_error"
    # the worker is being replaced; one given up on (engine_failed) will not be back by retrying
    retry = event.kind == Refusal.UNAVAILABLE and event.code != "engine_failed"
    return APIError(REFUSAL_STATUS[event.kind], event.message, type=kind, param=event.param, code=event.code,
                    headers={"Retry-After": "1"} if retry else None)


def engine_failed(event: Delta) -> APIError:
    return APIError(500, f"generation failed: {event.error}", type="server_error", code="engine_error")


@dataclass(frozen=True)
class Finish:
    """How one choice ended: the finish reason, the tool calls read from its output (and `rest`, the held text
    that is content after all), the token counts, and the token ids generated (where the engine reports them)."""

    reason: str  # "stop" or "length"
    calls: list[ToolCall]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    tokens: tuple[int, ...] = ()
    reasoning_tokens: int = 0  # of completion_tokens, those up to the end of the thinking
    rest: str = ""

    @property
    def whole_calls(self) -> bool:
        """The output is tool calls, none of them cut short by max_tokens."""
        return bool(self.calls) and all(c.complete for c in self.calls)


@dataclass(frozen=True)
class Step:
    """What one engine event adds to a choice: thinking, text that may go out now (with tools, held text waits:
    api/core/tools.py), the event's logprobs as the endpoint shows them, and, on the choice's last event, its Finish."""

    index: int
    thought: str
    text: str
    logprobs: dict | None = None
    finish: Finish | None = None
    bare: bool = False  # the last Step of a choice that showed no thinking, no text and no call
    last: bool = False  # the request's last Step: every choice has finished

    @property
    def answer(self) -> str:
        """The text that goes out with this Step, held text released at the end included."""
        return self.text + (self.finish.rest if self.finish is not None else "")


class _Choice:
    """What the reading of one choice keeps."""

    def __init__(self, parsed: ParsedRequest, hold: bool) -> None:
        thinking = parsed.thinking
        self.reader = ThinkingReader(thinking.opened) if thinking is not None and thinking.split else None
        self.held = ToolStream(parsed.tools) if hold and parsed.tools is not None else None
        self.n = 0
        self.ids: list[int] = []
        self.shown = False


# (choice index, event) -> the text and logprobs the endpoint shows of it (echo's prompt, completions' logprobs)
Show = Callable[[int, Delta], tuple[str, "dict | None"]]


async def steps(request: web.Request, parsed: ParsedRequest, fan: Fanout, accepted: list[Accepted],
                timer: RequestTimer, deadline: float, show: Show | None = None,
                hold: bool = True) -> AsyncGenerator[Step | None, None]:
    """Every choice's output, event by event, in the order events arrive.

    First None, once the engine's first event arrived and is neither a refusal nor a failure: a stream may
    send its headers now (an error before it is still an APIError the caller answers with an HTTP status).
    Then one Step per event; the iteration ends after every choice's Finish. `hold`: with tools, text that
    may be a call waits and the calls come with the Finish (a JSON answer that reads the calls from the whole
    text holds nothing). A later refusal or failure raises APIError; a client that left, ClientGone."""
    choices = [_Choice(parsed, hold) for _ in parsed.generates]
    left = len(choices)
    n = 0
    started = False
    while left:
        got = await next_event(request, fan, deadline if n == 0 else None)
        if got is None:
            raise ClientGone()
        index, event = got
        if isinstance(event, Rejected):
            raise rejected(event)
        if event.finish_reason == "error":
            raise engine_failed(event)
        if not started:
            started = True
            yield None
        ch = choices[index]
        n += event.n_tokens
        ch.n += event.n_tokens
        ch.ids += event.tokens
        timer.tokens(event.n_tokens)
        text, logprobs = show(index, event) if show is not None else (event.text, None)
        thought = ""
        if ch.reader is not None:
            pieces = None
            if event.n_tokens > 1 and ch.reader.split.thinking:  # each token's text, to count the thinking's
                # as the engine's text has them (sdk/output.py): an end-of-generation token shows none
                vocab = request.app[VOCAB].pieces.vocab
                pieces = [vocab.piece_bytes(t).decode("utf-8", errors="replace") for t in event.tokens]
            thought, text = ch.reader.feed(text, event.n_tokens, event.finish_reason is not None, pieces)
        if ch.held is not None:
            text = ch.held.feed(text)
        finish = None
        if event.finish_reason:
            rest, calls = ch.held.finish(event.finish_reason) if ch.held is not None else ("", [])
            a = accepted[index]
            finish = Finish(event.finish_reason, calls, a.prompt_tokens, ch.n, a.cached_tokens, tuple(ch.ids),
                            ch.reader.tokens if ch.reader is not None else 0, rest)
            left -= 1
            if not left:
                timer.finished(event.finish_reason)
        answer = text + (finish.rest if finish is not None else "")  # Step.answer, without building a Step for it
        bare = finish is not None and not ch.shown and not answer and not finish.calls
        ch.shown = ch.shown or bool(thought or answer)
        yield Step(index, thought, text, logprobs, finish, bare, last=not left)
