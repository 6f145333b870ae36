"""Slow and greedy clients are bounded and do not slow the others.

A client that sends its body a byte a second gets 408 after client_timeout; one that opens a stream and
never reads it is cancelled once its socket buffers are full for client_timeout, and its sequence is
freed; a connection that never sends a byte is closed after client_timeout; meanwhile a well-behaved
client is served as ever.
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
        assert 2.0 <= time.monotonic() - started < 10
    assert daemon.status()["http_connections"]["closed_silent"] == before + 1
    assert good(daemon)  # a connection that does send is served as ever
