"""An instant OpenAI-compatible stub server: answers with N tokens at once, to measure the client itself.

It runs in its own thread and event loop inside the benchmark's process, so the
numbers it yields are the client's ceiling with the stub's own cost included
(a lower bound on what the client alone can sustain). Tests use it as a real
HTTP server that is fast and whose answers are known.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

from aiohttp import web

__all__ = ["InstantServer", "STUB_MODEL"]

STUB_MODEL = "instant-stub"


class InstantServer:
    """A real HTTP server that streams max_tokens one-word tokens with no delay (or token_delay_s).

    max_output caps the tokens it produces whatever was asked, and error_every makes
    every n-th request fail with HTTP 500: both to see how the benchmark reports a
    server that does not honour the forced length, or fails.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        token_delay_s: float = 0.0,
        max_output: int | None = None,
        error_every: int | None = None,
    ):
        self.host = host
        self.port = port
        self.token_delay_s = token_delay_s
        self.max_output = max_output
        self.error_every = error_every
        self.requests = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": STUB_MODEL, "object": "model"}]})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        body = await request.json()
        if self.error_every and self.requests % self.error_every == 0:
            return web.json_response({"error": {"message": "stub: planned failure", "type": "server_error"}}, status=500)
        chat = request.path.endswith("/chat/completions")
        asked = int(body.get("max_tokens") or 16)
        n = asked if self.max_output is None else min(asked, self.max_output)
        finish = "length" if n == asked else "stop"  # capped: as if the model had met its end token
        prompt = body.get("prompt") if not chat else " ".join(m.get("content", "") for m in body.get("messages", []))
        prompt_tokens = len(str(prompt or "").split())
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
        if not body.get("stream"):
            text = " tok" * n
            choice = {"index": 0, "finish_reason": finish}
            choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            return web.json_response({"id": "stub", "object": kind.removesuffix(".chunk"), "created": created,
                                      "model": STUB_MODEL, "choices": [choice], "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for i in range(n):
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            choice = {"index": 0, "finish_reason": finish if i == n - 1 else None}
            choice.update({"delta": {"content": " tok"}} if chat else {"text": " tok"})
            chunk = {"id": "stub", "object": kind, "created": created, "model": STUB_MODEL, "choices": [choice]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        if (body.get("stream_options") or {}).get("include_usage"):
            chunk = {"id": "stub", "object": kind, "created": created, "model": STUB_MODEL, "choices": [], "usage": usage}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._start())
        except BaseException as exc:  # reported to start()'s caller
            self._failure = exc
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        loop.run_forever()
        if self._runner is not None:
            loop.run_until_complete(self._runner.cleanup())
        loop.close()

    async def _start(self) -> None:
        self._runner = web.AppRunner(self._app(), access_log=None)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        site = web.SockSite(self._runner, sock)
        await site.start()

    def start(self) -> "InstantServer":
        self._thread = threading.Thread(target=self._serve, name="syshax-bench-stub", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            raise RuntimeError(f"the instant stub server could not start: {self._failure}") from self._failure
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    def __enter__(self) -> "InstantServer":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()
