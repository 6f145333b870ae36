"""Streaming load generator: sends OpenAI completion requests over SSE and times every token.

One `StreamingClient` talks to one OpenAI-compatible server. `run_level` keeps
`concurrency` requests in flight (closed loop: each worker sends its next
request when the previous one ends) until the level's prompts are used up.
Every request yields a `RequestRecord`, failed ones included: errors are
counted by kind, never dropped. A request whose pooled keep-alive connection the
server had already closed (it fails before any byte of an answer) is sent once
more on a fresh connection and counted in `retries`, not as a failure: that
connection was the client's, not the server's, fault.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import aiohttp

from .prompts import Prompt

__all__ = ["RequestRecord", "LevelRun", "StreamingClient", "api_base", "list_models", "run_level", "run_streams"]

_DETAIL_CHARS = 300
# Failures of a connection before any answer came: the server closed a pooled keep-alive
# connection (llama.cpp's llama-server does so after each streamed answer without a
# Connection: close), and the request met the closed socket. Sent again, once, on a new one.
_STALE_CONNECTION_ERRORS = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, ConnectionResetError)


@dataclass
class RequestRecord:
    """What one request did, as the client saw it. Times are seconds; start_s is from the level's start."""

    index: int
    seed: int
    input_tokens: int
    start_s: float = 0.0
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    output_tokens_source: str = "none"  # "usage" (the server's count), "chunks" (counted here) or "none"
    chunks: int = 0
    prompt_tokens: int | None = None  # the server's usage.prompt_tokens, BOS and chat template included
    finish_reason: str | None = None
    done_marker: bool = False  # the stream ended with data: [DONE]
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None  # kind: http_<status>, timeout, stream_error, <exception class>, ...
    error_detail: str | None = None
    max_tokens: int | None = None  # the output length asked for
    retries: int = 0  # sent again on a fresh connection after a stale keep-alive one failed before any answer
    retry_detail: str | None = None  # what the stale connection raised
    conversation: int | None = None  # chat scenario: which conversation, from 0
    turn: int | None = None  # chat scenario: which turn of it, from 1

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first: (e2e - ttft) / (tokens - 1)."""
        if not self.ok or self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def as_dict(self) -> dict:
        record = asdict(self)
        record["tpot_s"] = self.tpot_s
        return record


@dataclass
class LevelRun:
    """The records of one concurrency level and the wall time from its first send to its last answer."""

    concurrency: int
    records: list[RequestRecord]
    wall_s: float


def api_base(url: str) -> str:
    """The OpenAI API root of a server given as http://host:port or http://host:port/v1."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


async def list_models(session: aiohttp.ClientSession, url: str) -> list[str]:
    """Model ids the server lists at GET /v1/models."""
    async with session.get(api_base(url) + "/models") as resp:
        if resp.status != 200:
            raise RuntimeError(f"GET {api_base(url)}/models answered HTTP {resp.status}: {(await resp.text())[:_DETAIL_CHARS]}")
        body = await resp.json(content_type=None)
    return [str(item["id"]) for item in body.get("data", []) if "id" in item]


class StreamingClient:
    """Sends one streamed completion per call and times it.

    force_length asks the server to produce exactly output_len tokens: `ignore_eos`
    (vLLM, llama.cpp's server, syshaxd) and `min_tokens` (vLLM) beside `max_tokens`;
    the record's output_tokens shows whether it did.
    """

    def __init__(
        self,
        url: str,
        model: str,
        output_len: int,
        *,
        endpoint: str = "completions",
        temperature: float = 0.0,
        force_length: bool = True,
        extra_body: dict | None = None,
        timeout_s: float = 600.0,
    ):
        if endpoint not in ("completions", "chat"):
            raise ValueError(f"--endpoint: {endpoint!r} is not allowed; allowed: completions, chat")
        self.endpoint = endpoint
        self.path = api_base(url) + ("/completions" if endpoint == "completions" else "/chat/completions")
        self.model = model
        self.output_len = output_len
        self.temperature = temperature
        self.force_length = force_length
        self.extra_body = dict(extra_body or {})
        self.timeout_s = timeout_s
        # the whole request is bounded by one timer (asyncio.timeout, in _attempt); aiohttp's own total would arm and
        # disarm a timer at every read of the stream, a token's cost to a client that shares the server's cores
        self.timeout = aiohttp.ClientTimeout()

    def payload(self, prompt: Prompt, output_len: int | None = None, messages: list[dict] | None = None) -> dict:
        """The request body for prompt (or, on the chat endpoint, for the conversation in messages)."""
        n = self.output_len if output_len is None else output_len
        if messages is not None and self.endpoint != "chat":
            raise ValueError("messages are sent on the chat endpoint only")
        body: dict = {
            "model": self.model,
            "max_tokens": n,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.endpoint == "completions":
            body["prompt"] = prompt.text
        else:
            body["messages"] = messages if messages is not None else [{"role": "user", "content": prompt.text}]
        if self.force_length:
            body["ignore_eos"] = True
            body["min_tokens"] = n
        body.update(self.extra_body)
        return body

    async def send(
        self,
        session: aiohttp.ClientSession,
        index: int,
        prompt: Prompt,
        level_start: float,
        output_len: int | None = None,
        *,
        messages: list[dict] | None = None,
        text_out: list[str] | None = None,
    ) -> RequestRecord:
        """Send one request, read its stream to the end, and say what happened.

        messages (chat endpoint): the whole conversation to send instead of prompt's text alone.
        text_out: the answer's text pieces are appended to it (the chat scenario resends them).
        A request that fails before any byte of an answer with a connection error is sent once
        more on a fresh connection; its times are the second try's and record.retries says so.
        """
        n = self.output_len if output_len is None else output_len
        body = json.dumps(self.payload(prompt, n, messages))
        record = self._record(index, prompt, n)
        try:
            await self._attempt(session, record, body, level_start, text_out)
        except _StaleConnection as stale:
            record = self._record(index, prompt, n)
            record.retries, record.retry_detail = 1, f"{stale.kind}: {stale.detail}"
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as fresh:
                try:
                    await self._attempt(fresh, record, body, level_start, text_out)
                except _StaleConnection as again:  # a new connection closed at once: the server's doing
                    record.error, record.error_detail = again.kind, again.detail
                    record.e2e_s = time.perf_counter() - level_start - record.start_s
        return record

    @staticmethod
    def _record(index: int, prompt: Prompt, max_tokens: int) -> RequestRecord:
        return RequestRecord(index=index, seed=prompt.seed, input_tokens=prompt.n_tokens, max_tokens=max_tokens)

    async def _attempt(
        self,
        session: aiohttp.ClientSession,
        record: RequestRecord,
        body: str,
        level_start: float,
        text_out: list[str] | None,
    ) -> None:
        """One try of a request, filling record; raises _StaleConnection when the connection failed before any answer."""
        token_times: list[float] = []
        usage_tokens: int | None = None
        answered = False  # the status line came: from here on a failure is the server's, and counted
        start = time.perf_counter()
        record.start_s = start - level_start
        try:
            async with asyncio.timeout(self.timeout_s), session.post(
                self.path, data=body, headers={"Content-Type": "application/json"}, timeout=self.timeout
            ) as resp:
                answered = True
                if resp.status != 200:
                    record.error = f"http_{resp.status}"
                    record.error_detail = (await resp.text())[:_DETAIL_CHARS]
                    record.e2e_s = time.perf_counter() - start
                    return
                buffer = b""
                async for data in resp.content.iter_any():
                    now = time.perf_counter()
                    if record.done_marker:
                        continue  # read to the end so the connection goes back to the pool
                    buffer += data
                    while not record.done_marker:
                        newline = buffer.find(b"\n")
                        if newline < 0:
                            break
                        line = buffer[:newline].strip()
                        buffer = buffer[newline + 1 :]
                        if not line.startswith(b"data:"):
                            continue  # blank separators, comments, event: lines
                        payload = line[5:].strip()
                        if payload == b"[DONE]":
                            record.done_marker = True
                            record.e2e_s = now - start
                            break
                        event = json.loads(payload)
                        if not isinstance(event, dict):
                            continue
                        if "error" in event:
                            record.error = "stream_error"
                            record.error_detail = json.dumps(event["error"])[:_DETAIL_CHARS]
                            continue
                        usage = event.get("usage")
                        if isinstance(usage, dict):
                            if usage.get("completion_tokens") is not None:
                                usage_tokens = int(usage["completion_tokens"])
                            if usage.get("prompt_tokens") is not None:
                                record.prompt_tokens = int(usage["prompt_tokens"])
                        for choice in event.get("choices") or ():
                            if self.endpoint == "completions":
                                text = choice.get("text")
                            else:
                                text = (choice.get("delta") or {}).get("content")
                            if text:
                                token_times.append(now)
                                if text_out is not None:
                                    text_out.append(text)
                            if choice.get("finish_reason"):
                                record.finish_reason = choice["finish_reason"]
                end = time.perf_counter()
        except asyncio.TimeoutError:
            record.error = "timeout"
            record.error_detail = f"no complete answer within {self.timeout_s} s"
        except aiohttp.ClientResponseError as exc:
            record.error = f"http_{exc.status}"
            record.error_detail = str(exc)[:_DETAIL_CHARS]
        except _STALE_CONNECTION_ERRORS as exc:
            # A refused or unreachable connect (ClientConnectorError) was never a pooled connection.
            if not answered and not isinstance(exc, aiohttp.ClientConnectorError):
                raise _StaleConnection(type(exc).__name__, str(exc)[:_DETAIL_CHARS]) from exc
            record.error = type(exc).__name__
            record.error_detail = str(exc)[:_DETAIL_CHARS]
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            record.error = type(exc).__name__
            record.error_detail = str(exc)[:_DETAIL_CHARS]
        else:
            if record.e2e_s is None:
                record.e2e_s = end - start
            if record.error is None and record.finish_reason is None:
                if record.done_marker:
                    # llama_cpp.server does this to a running stream when another request arrives,
                    # unless it runs with --interrupt_requests False.
                    record.error = "truncated_stream"
                    record.error_detail = "data: [DONE] came before any choice had a finish_reason: the server cut the answer short"
                else:
                    record.error = "incomplete_stream"
                    record.error_detail = "the stream ended without a finish_reason or data: [DONE]"
        if record.e2e_s is None:
            record.e2e_s = time.perf_counter() - start
        record.chunks = len(token_times)
        if token_times:
            record.ttft_s = token_times[0] - start
            record.itl_s = [b - a for a, b in zip(token_times, token_times[1:])]
        if usage_tokens is not None:
            record.output_tokens, record.output_tokens_source = usage_tokens, "usage"
        elif token_times:
            record.output_tokens, record.output_tokens_source = len(token_times), "chunks"
        if record.error is None and not token_times:
            record.error = "no_tokens"
            record.error_detail = "the stream carried no output text"


class _StaleConnection(Exception):
    """A connection failed before any byte of an answer: kind is the exception's class name."""

    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind = kind
        self.detail = detail


async def run_level(
    client: StreamingClient,
    session: aiohttp.ClientSession,
    prompts: Sequence[Prompt],
    concurrency: int,
    on_record: Callable[[RequestRecord], None] | None = None,
    output_len: int | Sequence[int] | None = None,
    arrival_gap_s: float = 0.0,
) -> LevelRun:
    """Send every prompt, keeping `concurrency` requests in flight, and collect all records.

    output_len: one length for all, or one per prompt (a staggered finish: slots free in scattered order).
    arrival_gap_s: staggered arrivals: the k-th of the first `concurrency` prompts is sent k x arrival_gap_s
    after the level starts (0: all at once), so that they do not all arrive in one step; each worker then sends
    the next prompt left when its last one ends.
    """
    if arrival_gap_s < 0:
        raise ValueError(f"arrival_gap_s: {arrival_gap_s} is not allowed; it must be 0 or more")
    if output_len is not None and not isinstance(output_len, int) and len(output_len) != len(prompts):
        raise ValueError(f"output_len: {len(output_len)} lengths for {len(prompts)} prompts")
    pending = deque(enumerate(prompts))
    workers = max(1, min(concurrency, len(prompts)))
    # staggered: each worker's first prompt is its own, else a worker done before the next one starts would take it
    first = [pending.popleft() for _ in range(min(workers, len(prompts)) if arrival_gap_s else 0)]
    records: list[RequestRecord] = []
    level_start = time.perf_counter()

    async def send(index: int, prompt: Prompt) -> None:
        n = output_len if output_len is None or isinstance(output_len, int) else output_len[index]
        record = await client.send(session, index, prompt, level_start, n)
        records.append(record)
        if on_record is not None:
            on_record(record)

    async def worker(k: int) -> None:
        if k < len(first):
            await asyncio.sleep(k * arrival_gap_s)
            await send(*first[k])
        while pending:
            await send(*pending.popleft())

    await asyncio.gather(*(worker(k) for k in range(workers)))
    wall_s = time.perf_counter() - level_start
    records.sort(key=lambda r: r.index)
    return LevelRun(concurrency, records, wall_s)


async def run_streams(url: str, prompts, output_len: int) -> dict:
    """One wave of streams, all at once (the bench/ scripts' working load): ok count, tok/s, TPOT p50 and p90."""
    async with aiohttp.ClientSession() as session:
        model = (await list_models(session, url))[0]
        client = StreamingClient(url, model, output_len)
        level = await run_level(client, session, prompts, len(prompts))
    ok = [r for r in level.records if r.ok]
    tpots = sorted(1000 * r.tpot_s for r in ok if r.tpot_s is not None)
    return {"ok": len(ok), "requests": len(level.records), "tok_s": sum(r.output_tokens for r in ok) / level.wall_s,
            "tpot_p50_ms": statistics.median(tpots),
            "tpot_p90_ms": statistics.quantiles(tpots, n=10, method="inclusive")[-1]}
