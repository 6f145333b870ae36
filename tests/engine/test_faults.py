"""Faults and limits: hung workers (SIGSTOP) are replaced, limits hold, hostile bodies never get a 5xx.

Each test adds to FIGURES; the module prints them at the end (pytest -s shows the line):
requests sent / completed / ended with a clean error / lost, faults injected / survived, bad inputs tried / 5xx seen.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import time
from collections import Counter

import openai
import psutil
import pytest

from conftest import MODEL_NAME, http_json, start_daemon, wait_for

HEARTBEAT = 3.0  # worker_heartbeat_timeout in these daemons (the default is 30 s)
FIGURES: Counter = Counter()


@pytest.fixture(scope="module", autouse=True)
def figures():
    yield FIGURES
    f = FIGURES
    lost = f["sent"] - f["completed"] - f["clean_error"]  # neither answered nor told why: must be 0
    print(f"\n[faults] requests sent {f['sent']} / completed {f['completed']} / ended with a clean error "
          f"{f['clean_error']} / lost {lost}; faults injected {f['faults']} / survived {f['survived']}; "
          f"bad inputs tried {f['bad']} / 5xx seen {f['5xx']}; connections refused at the cap {f['conn_refused']}")


def hung_config(model, **extra) -> dict:
    return {"model": str(model), "worker_heartbeat_timeout": HEARTBEAT, "handoff_timeout": 0.5,
            "worker_restart_delay": 0.2} | extra


def worker(d, name: str) -> dict:
    return next(w for w in d.status()["workers"] if w["name"] == name)


def settled(d, timeout=30.0) -> dict:
    """The status once nothing is in flight and the ring is empty."""
    def quiet():
        s = d.status()
        busy = [w for w in s["workers"] if w["role"] != "prefill" and (w["stats"].get("running") or
                                                                        w["stats"].get("waiting"))]
        ring_used = s["kv"]["ring"]["used_bytes"] if s["kv"] else 0
        return s if s["in_flight"] == 0 and not busy and ring_used == 0 and s["ready"] else None
    return wait_for(quiet, timeout, "the daemon to settle", every=0.3)


def complete(client, prompt, route="cpu", max_tokens=8):
    FIGURES["sent"] += 1
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                  extra_body={"syshax": {"mode": route}})
    FIGURES["completed"] += 1
    return r.choices[0].text


# --- hung workers ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cpu(default_model, tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("hung-cpu"), hung_config(default_model))
    yield d
    assert d.stop() == 0, d.log()


def test_an_idle_worker_is_not_taken_for_hung(cpu):
    time.sleep(2 * HEARTBEAT)  # idle workers still report every 0.5 s
    w = worker(cpu, "cpu0")
    assert w["state"] == "ready" and w["hangs"] == 0 and w["restarts"] == 0


def test_a_stopped_cpu_worker_is_killed_and_replaced(cpu):
    client = openai.OpenAI(base_url=cpu.base_url, api_key="x", max_retries=0, timeout=60)
    old = worker(cpu, "cpu0")
    FIGURES["sent"] += 2
    stream = iter(client.completions.create(model=MODEL_NAME, prompt="Tell a long story", max_tokens=200,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    next(stream)
    os.kill(old["pid"], signal.SIGSTOP)
    FIGURES["faults"] += 1
    stopped = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        # sent to the stopped worker: no answer until the worker is replaced, then sent again to the replacement
        waiting = pool.submit(http_json, f"{cpu.base_url}/completions",
                              {"model": MODEL_NAME, "prompt": "Are you there?", "max_tokens": 4})
        rest = pool.submit(list, stream)  # the stream resumes on the replacement with the tokens so far
        wait_for(lambda: worker(cpu, "cpu0")["hangs"] == 1, 30, "the hung worker to be noticed", every=0.05)
        noticed = time.monotonic() - stopped
        chunks = rest.result()
        status, body = waiting.result()
    assert HEARTBEAT - 0.5 <= noticed < HEARTBEAT + 6, noticed
    assert status == 200 and body["usage"]["completion_tokens"] > 0, body
    assert chunks[-1].usage.completion_tokens == 200  # the stream went on to its end, on the replacement
    FIGURES["completed"] += 2
    new = wait_for(lambda: (w := worker(cpu, "cpu0"))["state"] == "ready" and w["pid"] != old["pid"] and w,
                   what="the replacement worker")
    assert new["hangs"] == 1 and new["restarts"] == 1
    assert not psutil.pid_exists(old["pid"])  # killed and reaped, not left stopped
    assert "it is hung" in cpu.log()
    assert cpu.status()["rescued"] == {"resent": 1, "resumed": 1, "lost": 0}
    assert [complete(client, "Back again?", max_tokens=4) for _ in range(3)]
    assert settled(cpu)["in_flight"] == 0
    FIGURES["survived"] += 1


def test_a_silent_worker_is_hung_only_when_it_makes_no_progress():
    import asyncio
    import subprocess
    import sys

    from syshaxd.engine.supervisor import WorkerHandle
    from syshaxd.sdk.types import EngineSpec

    async def looks() -> dict:
        handle = WorkerHandle("w", EngineSpec("llamacpp", "generate", "m.gguf", "m"), "info", 0.1, 1.0)
        procs = {"busy": subprocess.Popen([sys.executable, "-c", "while True: pass"]),  # a long native step
                 "blocked": subprocess.Popen(["sleep", "60"]),  # a deadlock looks like this: no CPU at all
                 "stopped": subprocess.Popen(["sleep", "60"])}
        os.kill(procs["stopped"].pid, signal.SIGSTOP)
        try:
            seen = {}
            for name, proc in procs.items():
                handle._cpu_seen = None
                first = handle._hung(proc.pid, 2.0)
                await asyncio.sleep(0.5)
                seen[name] = (first, handle._hung(proc.pid, 2.0))
            handle._cpu_seen = None
            seen["busy_too_long"] = handle._hung(procs["busy"].pid, 1.0 * WorkerHandle.BUSY_GRACE + 0.1)
            return seen
        finally:
            for proc in procs.values():
                proc.kill()
                proc.wait()

    seen = asyncio.run(looks())
    assert seen["stopped"] == (True, True)  # at once
    assert seen["blocked"] == (False, True)  # after one more look without progress
    assert seen["busy"] == (False, False)  # computing: spared...
    assert seen["busy_too_long"] is True  # ...up to BUSY_GRACE times the timeout


@pytest.fixture(scope="module")
def hetero(default_model, tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("hung-hetero"),
                     # no prefix cache: the long prompt must take seconds to prefill every time
                     hung_config(default_model, mode="hetero", prefill_cpu_affinity="0", n_ctx=1024,
                                 prefix_cache_mb=0))
    yield d
    assert d.stop() == 0, d.log()


def test_a_stopped_prefill_worker_is_replaced_and_nothing_is_lost(hetero):
    client = openai.OpenAI(base_url=hetero.base_url, api_key="x", max_retries=0, timeout=120)
    long_prompt, short_prompt = "word " * 900, "The capital of France is"
    expected = {p: complete(client, p) for p in (long_prompt, short_prompt)}
    assert complete(client, short_prompt, "hetero") == expected[short_prompt]  # through the ring first
    before = hetero.status()["kv"]
    old = worker(hetero, "prefill0")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(complete, client, long_prompt, "hetero")
        wait_for(lambda: worker(hetero, "prefill0")["in_flight"] >= 1, 30, "the prefill to start", every=0.02)
        os.kill(old["pid"], signal.SIGSTOP)  # mid-prefill: the long prompt takes seconds on one core
        FIGURES["faults"] += 1
        second = pool.submit(complete, client, short_prompt, "hetero")  # queued on the stopped worker
        assert first.result() == expected[long_prompt]
        assert second.result() == expected[short_prompt]
    new = wait_for(lambda: (w := worker(hetero, "prefill0"))["state"] == "ready" and w["pid"] != old["pid"] and w,
                   what="the replacement prefill worker")
    assert new["hangs"] == 1 and not psutil.pid_exists(old["pid"])
    kv = hetero.status()["kv"]
    assert kv["fallbacks"].get("prefill_died", 0) >= before["fallbacks"].get("prefill_died", 0) + 1
    # the ring works again and is left empty: whatever the stopped prefill held was reclaimed
    assert complete(client, short_prompt, "hetero") == expected[short_prompt]
    status = settled(hetero)
    assert status["kv"]["records_read"] > before["records_read"]
    assert status["kv"]["ring"]["used_bytes"] == 0
    decoder = worker(hetero, "decode0")
    assert decoder["hangs"] == 0 and decoder["restarts"] == 0  # only the hung worker was replaced
    FIGURES["survived"] += 1


# --- limits, all in one place -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def limited(default_model, tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("limits"),
                     {"model": str(default_model), "max_body_bytes": 65536, "n_ctx": 96, "max_connections": 4,
                      "cpu_max_batch_size": 2})
    yield d
    assert d.stop() == 0, d.log()


HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"


def _raw(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        got = b""
        while chunk := sock.recv(65536):
            got += chunk
        return got


def test_body_prompt_and_max_tokens_limits(limited):
    url = f"{limited.base_url}/completions"
    cases = [  # body, status, param, code
        ({"prompt": "a" * 100_000}, 413, None, "request_too_large"),
        ({"prompt": "word " * 200}, 400, "prompt", "context_length_exceeded"),
        ({"prompt": "Once upon a time", "max_tokens": 93}, 400, "max_tokens", "context_length_exceeded"),
        ({"prompt": "Once upon a time", "max_tokens": 10**9}, 400, "max_tokens", "context_length_exceeded"),
        ({"prompt": "Once upon a time", "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
        ({"prompt": "Once upon a time", "max_tokens": -1}, 400, "max_tokens", "invalid_value"),
    ]
    for body, want, param, code in cases:
        FIGURES["bad"] += 1
        status, answer = http_json(url, {"model": MODEL_NAME} | body)
        FIGURES["5xx"] += status >= 500
        assert (status, answer["error"]["param"], answer["error"]["code"]) == (want, param, code), answer
    # the largest request that fits is served: 4 prompt tokens + 92 = n_ctx
    status, answer = http_json(url, {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 92,
                                     "ignore_eos": True}, timeout=120)
    assert status == 200 and answer["usage"]["total_tokens"] == 96


def test_connections_past_max_connections_get_a_quick_503(limited):
    idle = [socket.create_connection(("127.0.0.1", limited.port)) for _ in range(3)]
    try:
        status = limited.status()  # the 4th connection: at the cap, still served
        assert status["http_connections"]["open"] == 4 and status["http_connections"]["max_connections"] == 4
        time.sleep(0.3)  # the daemon sees the status request's connection close
        idle.append(socket.create_connection(("127.0.0.1", limited.port)))
        time.sleep(0.2)
        started = time.monotonic()
        answer = _raw(limited.port, HEALTH)
        took = time.monotonic() - started
        FIGURES["conn_refused"] += 1
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in head, answer
        assert json.loads(body)["error"]["code"] == "too_many_connections" and took < 1.0
        # a burst over the cap: every connection gets an answer, none hangs
        with concurrent.futures.ThreadPoolExecutor(20) as pool:
            burst = list(pool.map(lambda _: _raw(limited.port, HEALTH), range(40)))
        assert all(a.startswith(b"HTTP/1.1 503") for a in burst)
        FIGURES["conn_refused"] += len(burst)
    finally:
        for sock in idle:
            sock.close()
    time.sleep(0.3)
    status = wait_for(lambda: (s := limited.status())["http_connections"]["open"] == 1 and s, 10, "closed sockets")
    assert status["http_connections"]["refused"] >= 41
    assert http_json(f"{limited.url}/health")[0] == 200


def test_the_open_file_limit_is_raised_to_fit_max_connections():
    import subprocess
    import sys

    code = ("import resource as r; soft, hard = r.getrlimit(r.RLIMIT_NOFILE); "
            "r.setrlimit(r.RLIMIT_NOFILE, (64, hard)); from syshaxd.api.core.connections import ensure_file_limit; "
            "print(ensure_file_limit(1024), r.getrlimit(r.RLIMIT_NOFILE)[0])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["1280", "1280"], done.stderr


def test_max_connections_is_checked_and_documented():
    from syshaxd.config import ConfigError, from_mapping

    with pytest.raises(ConfigError, match="max_connections: must be at least 1"):
        from_mapping({"max_connections": 0})
    with pytest.raises(ConfigError, match="worker_heartbeat_timeout: must be above handoff_timeout"):
        from_mapping({"worker_heartbeat_timeout": 1.0, "handoff_timeout": 2.0})
    assert from_mapping({"worker_heartbeat_timeout": 0}).worker_heartbeat_timeout == 0  # off


# --- hostile bodies -----------------------------------------------------------------------------------

HOSTILE_BODIES = [
    b"[" * 200_000,  # nesting deeper than the JSON parser's recursion limit
    b'{"model": "%s", "prompt": "' + b"\\ud800" + b'"}',  # a lone surrogate: valid JSON, not text
    b'{"model": "%s", "prompt": "ok", "stop": ["\\udfff"]}',
    b'{"model": "%s", "messages": [{"role": "user", "content": "\\ud83d"}]}',
    b'{"model": "%s", "prompt": "x", "temperature": NaN}',
    b'{"model": "%s", "prompt": "x", "top_p": Infinity}',
    b'{"model": "%s", "prompt": "x", "max_tokens": 1e999}',
    b'{"model": "%s", "prompt": "x", "top_k": 99999999999999999999}',
    b'{"model": "%s", "prompt": "x", "seed": 999999999999999999999999}',
    b'{"model": "%s", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",  # past int() digit limit
    b'{"model": "%s", "prompt": [99999999]}',  # outside the vocabulary
    b'{"model": "%s", "prompt": [-1]}',
    b'{"model": "%s", "prompt": [[]]}',
    b'{"model": "%s", "prompt": [true, false]}',
    b'{"model": "%s", "prompt": {"text": "x"}}',
    b'{"model": "%s", "prompt": "\\u0000\\u0000"}',
    b'{"model": "%s", "prompt": "x", "stream": "yes"}',
    b'{"model": "%s", "prompt": "x", "stream_options": {"include_usage": true}}',
    b'{"model": "%s", "prompt": "x", "syshax": {"mode": "gpu"}}',
    b'{"model": "%s", "prompt": "x", "syshax": "hetero"}',
    b'{"model": "%s", "prompt": "x", "logit_bias": {"1": 100}}',
    b'{"model": ["%s"], "prompt": "x"}',
    b'{"model": "%s", "messages": [{"role": "user"}]}',
    b'{"model": "%s", "messages": [{"role": "user", "content": [{"type": "text"}]}]}',
    b'{"model": "%s", "messages": [null]}',
    b'{"model": "%s", "messages": [{"role": "tool", "content": "x"}], "tools": [{"type": "function"}]}',
    b'{"model": "%s", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json"}}',
    b'{"model": "%s", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": "9"}',
    b"null",
    b'"just a string"',
    b"\xef\xbb\xbf{}",  # a UTF-8 byte-order mark
    b"",
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_hostile_bodies_get_4xx_and_the_daemon_keeps_serving(daemon, path):
    import urllib.error
    import urllib.request

    statuses = Counter()
    for raw in HOSTILE_BODIES:
        data = raw.replace(b"%s", MODEL_NAME.encode()) if raw.startswith(b"{") else raw
        req = urllib.request.Request(f"{daemon.url}{path}", data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                status, body = resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            status, body = exc.code, json.loads(exc.read())
        FIGURES["bad"] += 1
        FIGURES["5xx"] += status >= 500
        statuses[status] += 1
        assert 400 <= status < 500 or status == 200, (data[:80], status, body)
        if status != 200:
            assert body["error"]["message"] and body["error"]["type"] == "invalid_request_error", body
    assert statuses[200] <= 2  # a NUL-only prompt or a tool message may be served; nothing else is
    assert http_json(f"{daemon.base_url}/completions", {"model": MODEL_NAME, "prompt": "ok", "max_tokens": 2})[0] == 200
