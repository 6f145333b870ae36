"""A stream's writes as they reach the client: held to the end of the event loop's pass and written back to back
(api/core/sse.py), they still make a byte-exact HTTP body.

Several streams at once (one engine step feeds them all, so their writes are held together) read whole, with the
same texts as the same requests answered as JSON; the raw bytes on an HTTP/1.1 connection are valid chunks with
nothing after the last, so that the connection serves its next request; an HTTP/1.0 client, which gets no chunks,
gets the same events.
"""

from __future__ import annotations

import concurrent.futures
import json
import socket

from conftest import MODEL_NAME

PROMPTS = [f"Write a short story about the number {i}." for i in range(6)]


def test_streams_that_share_engine_steps_each_read_whole_with_their_json_texts(client):
    def streamed(prompt: str) -> tuple[str, str | None, int]:
        text, finish, usage = [], None, 0
        for chunk in client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=64, temperature=0,
                                               stream=True, stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True}):
            if chunk.choices:
                text.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        return "".join(text), finish, usage

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        streams = list(pool.map(streamed, PROMPTS))
    for prompt, (text, finish, usage) in zip(PROMPTS, streams):
        answer = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=64, temperature=0,
                                           extra_body={"ignore_eos": True})
        assert (text, finish, usage) == (answer.choices[0].text, "length", 64)


def _json_text(client, body: dict) -> str:
    extra = {k: body[k] for k in ("ignore_eos",) if k in body}
    return client.completions.create(**{k: v for k, v in body.items() if k not in extra},
                                     extra_body=extra).choices[0].text


def _request(port: int, body: dict, version: str = "1.1") -> bytes:
    data = json.dumps(body).encode()
    return (f"POST /v1/completions HTTP/{version}\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


class _Reader:
    """An HTTP/1.1 response read off a raw socket, its chunked body decoded strictly."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def _fill(self) -> None:
        more = self.sock.recv(65536)
        assert more, "the connection closed mid-response"
        self.buf += more

    def line(self) -> bytes:
        while b"\r\n" not in self.buf:
            self._fill()
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        data, self.buf = self.buf[:n], self.buf[n:]
        return data

    def head(self) -> dict[str, str]:
        status = self.line()
        assert status.startswith(b"HTTP/1.1 200"), status
        headers = {}
        while line := self.line():
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        return headers

    def chunked_body(self) -> bytes:
        body = b""
        while True:
            size = int(self.line(), 16)  # a size line that is not hex fails here
            data = self.exactly(size)
            assert self.exactly(2) == b"\r\n", "a chunk's data is not followed by CRLF"
            if size == 0:
                return body
            body += data


def _lines(body: bytes) -> list[str]:
    """A stream's data lines ([DONE] included)."""
    assert body.endswith(b"\n\n")
    return [e.removeprefix(b"data: ").decode() for e in body.split(b"\n\n") if e]


def _events(body: bytes) -> tuple[str, list[str]]:
    """The text of a completions stream's events, and its data lines ([DONE] included)."""
    lines = _lines(body)
    text = "".join(c["text"] for line in lines if line != "[DONE]" for c in json.loads(line)["choices"])
    return text, lines


def test_an_http_1_1_stream_is_valid_chunks_and_its_connection_serves_the_next_request(daemon, client):
    body = {"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    answer = _json_text(client, body)
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=120) as sock:
        reader = _Reader(sock)
        sock.sendall(_request(daemon.port, body | {"stream": True}))
        assert reader.head()["transfer-encoding"] == "chunked"
        text, lines = _events(reader.chunked_body())
        assert text == answer and lines[-1] == "[DONE]" and lines.count("[DONE]") == 1
        assert json.loads(lines[-2])["choices"][0]["finish_reason"] == "length"
        assert reader.buf == b""  # nothing after the last chunk
        sock.sendall(_request(daemon.port, body))  # the same connection, kept alive
        headers = reader.head()
        assert json.loads(reader.exactly(int(headers["content-length"])))["choices"][0]["text"] == answer


def test_events_ready_in_one_pass_go_out_in_order_before_the_end():
    """sse.stream on a real aiohttp server and a raw socket: events an endpoint yields without waiting (its first,
    a second that is held for the pass's end, and a last Batch with the stream's end) reach the client in order,
    the held one before the end's chunk, and nothing after it. Two choices that finish at one engine step end a
    stream so."""
    import asyncio
    from types import SimpleNamespace

    from aiohttp import web

    from syshaxd.api.core import sse
    from syshaxd.api.core.app_keys import STATE

    async def events():
        yield {"n": 1}
        yield {"n": 2}  # held: the headers went with the first
        await asyncio.sleep(0.05)  # the pass ends: what is held goes
        yield {"n": 3}
        yield {"n": 4}  # held, and the end follows in the same pass
        yield sse.Batch([{"n": 5}], last=True)

    async def handler(request):
        return await sse.stream(request, lambda: "cpu", "r", events(), sse.OPENAI)

    async def main() -> bytes:
        app = web.Application()
        app[STATE] = SimpleNamespace(config=SimpleNamespace(client_timeout=10.0))  # type: ignore[misc]
        app[sse.PASS_WRITES] = sse.PassWrites()
        app.router.add_post("/", handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        listening = socket.socket()
        listening.bind(("127.0.0.1", 0))
        port = listening.getsockname()[1]
        await web.SockSite(runner, listening).start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(f"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n".encode())
            await writer.drain()
            raw = b""
            while not raw.endswith(b"0\r\n\r\n"):
                raw += await asyncio.wait_for(reader.read(65536), 10)
            try:  # anything written after the end would come now
                raw += await asyncio.wait_for(reader.read(65536), 0.3)
            except TimeoutError:
                pass
            writer.close()
            return raw
        finally:
            await runner.cleanup()

    raw = asyncio.run(main())
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower()
    sock = SimpleNamespace(recv=lambda n: b"")
    reader = _Reader(sock)  # type: ignore[arg-type]
    reader.buf = body
    lines = _lines(reader.chunked_body())
    assert reader.buf == b""
    assert lines == [json.dumps({"n": i}) for i in range(1, 6)] + ["[DONE]"]


def test_an_http_1_0_client_gets_the_same_events_without_chunks(daemon, client):
    body = {"model": MODEL_NAME, "prompt": PROMPTS[1], "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    answer = _json_text(client, body)
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=120) as sock:
        sock.sendall(_request(daemon.port, body | {"stream": True}, version="1.0"))
        raw = b""
        while more := sock.recv(65536):  # the body ends with the connection
            raw += more
    head, _, data = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200") or head.startswith(b"HTTP/1.1 200"), head[:40]
    assert b"chunked" not in head.lower()
    text, lines = _events(data)
    assert text == answer and lines[-1] == "[DONE]"
