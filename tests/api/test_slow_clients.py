"""Slow and greedy clients are bounded and do not slow the others.

A client that sends its body a byte a second gets 408 after client_timeout; one that opens a stream and
never reads it is cancelled once its socket buffers are full for client_timeout, and its sequence is
freed; a connection that never sends a byte, or sends its request head a byte a second, is closed after
client_timeout; meanwhile a well-behaved client is served as ever.
"""

from __future__ import annotations

import json
import socket
import time

import openai
import pytest

from conftest import MODEL_NAME, start_daemon


@pytest.fixture(scope="module")
def daemon(default_model, tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("slow"), {"model": str(default_model), "model_name": MODEL_NAME,
                                                       "client_timeout": 2.0})
    yield d
    assert d.stop() == 0, d.log()


def head(port: int, body_len: int) -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {body_len}\r\n\r\n").encode()


def good(d) -> str:
    client = openai.OpenAI(base_url=d.base_url, api_key="x", max_retries=0, timeout=60)
    return client.completions.create(model=MODEL_NAME, prompt="The capital of France is", max_tokens=8,
                                      temperature=0).choices[0].text


def test_a_body_sent_a_byte_a_second_gets_408_and_the_others_are_served(daemon):
    body = json.dumps({"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4}).encode()
    expected = good(daemon)
    with socket.create_connection(("127.0.0.1", daemon.port)) as sock:
        sock.sendall(head(daemon.port, len(body)))
        started = time.monotonic()
        sock.settimeout(0.5)
        answer = b""
        for byte in body[:-1]:  # never the whole body
            sock.sendall(bytes([byte]))
            assert good(daemon) == expected  # others go on meanwhile
            try:
                answer = sock.recv(4096)
            except TimeoutError:
                continue
            if answer:
                break
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert 2.0 <= time.monotonic() - started < 15
        assert b'"client_timeout"' in answer or b"client_timeout" in answer


def test_a_stream_nobody_reads_is_cancelled_and_its_sequence_freed(daemon):
    body = json.dumps({"model": MODEL_NAME, "prompt": "Tell me a long story.", "max_tokens": 3000,
                       "ignore_eos": True, "stream": True}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills fast, and is never read
    sock.connect(("127.0.0.1", daemon.port))
    try:
        sock.sendall(head(daemon.port, len(body)) + body)
        deadline = time.monotonic() + 120
        while daemon.status()["in_flight"] == 0:  # it starts
            assert time.monotonic() < deadline
            time.sleep(0.1)
        expected_alone = good(daemon)  # served beside it
        while daemon.status()["in_flight"] > 0:  # and is let go without a single read
            assert time.monotonic() < deadline, "the unread stream still holds its sequence"
            time.sleep(0.2)
        while True:  # the worker's own report follows within its stats interval
            stats = daemon.status()["workers"][0]["stats"]
            if stats["free_slots"] == stats["max_batch_size"] or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert stats["free_slots"] == stats["max_batch_size"]
        assert stats["generated_tokens"] < 3000  # cancelled, not run to its end
        assert good(daemon) == expected_alone
        assert "read nothing of the stream" in daemon.log()
    finally:
        sock.close()


def test_a_connection_that_sends_nothing_is_closed_after_client_timeout(daemon):
    before = daemon.status()["http_connections"]["closed_silent"]
    with socket.create_connection(("127.0.0.1", daemon.port)) as silent:
        silent.settimeout(15)
        started = time.monotonic()
        assert silent.recv(1) == b""  # the daemon closed it
        # the daemon's clock starts at accept, which a loaded test process may see after the fact
        assert 1.5 <= time.monotonic() - started < 10
    assert daemon.status()["http_connections"]["closed_silent"] == before + 1
    assert good(daemon)  # a connection that does send is served as ever


def trickle_until_closed(sock: socket.socket, data: bytes, each=None) -> float:
    """Send data a byte a second until the daemon closes the socket; the seconds that took."""
    started = time.monotonic()
    sock.settimeout(1.0)
    for byte in data:
        try:
            sock.sendall(bytes([byte]))
            if sock.recv(4096) == b"":  # closed; an answer would mean the head was taken as complete
                return time.monotonic() - started
        except TimeoutError:
            pass
        except (BrokenPipeError, ConnectionResetError):
            return time.monotonic() - started
        if each is not None:
            each()
    raise AssertionError("the daemon kept a connection whose head arrived a byte a second")


def test_a_request_head_sent_a_byte_a_second_is_closed_after_client_timeout(daemon):
    expected = good(daemon)
    before = daemon.status()["http_connections"]
    with socket.create_connection(("127.0.0.1", daemon.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        took = trickle_until_closed(sock, b"X-Slow: " + b"a" * 60, each=lambda: assert_good(daemon, expected))
    assert 1.0 <= took < 10  # client_timeout is 2 s, counted from the head's first byte
    after = daemon.status()["http_connections"]
    assert after["closed_slow_head"] == before["closed_slow_head"] + 1
    assert after["closed_silent"] == before["closed_silent"]  # it did send
    assert good(daemon) == expected


def assert_good(d, expected: str) -> None:
    assert good(d) == expected  # others are served meanwhile


def test_the_next_head_on_a_kept_alive_connection_is_bounded_too(daemon):
    """After a whole request and its body, the next head's first byte starts its own client_timeout."""
    body = json.dumps({"model": "no-such-model", "prompt": "hi"}).encode()
    before = daemon.status()["http_connections"]["closed_slow_head"]
    with socket.create_connection(("127.0.0.1", daemon.port)) as sock:
        sock.settimeout(10)
        sock.sendall(head(daemon.port, len(body)) + body)
        answer = b""
        while b"model_not_found" not in answer:
            answer += sock.recv(4096)
        assert answer.startswith(b"HTTP/1.1 404"), answer
        time.sleep(3)  # idle between requests is not a slow head (aiohttp's keep-alive timeout bounds it)
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        took = trickle_until_closed(sock, b"Host: " + b"h" * 60)
    assert 1.0 <= took < 10
    assert daemon.status()["http_connections"]["closed_slow_head"] == before + 1
