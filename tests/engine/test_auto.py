"""auto mode as a user meets it: the GPU engine serves while it has room, offloads decodes to the CPU when it is
saturated, moves them back when it frees up, and says where each request ran.

On this host the "GPU" engine is a llama.cpp worker on CPU 0 (prefill_engine = "llamacpp"), with room for two
sequences (max_num_seqs = 2); the CPU decoder on CPU 1 has four slots. tests/plugins/test_vllm.py runs the same scene with
vLLM's CPU build as the GPU engine.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from conftest import MODEL_NAME, http_json, start_daemon

pytestmark = pytest.mark.slow

AUTO = {"mode": "auto", "prefill_engine": "llamacpp", "prefill_cpu_affinity": "0", "max_num_seqs": 2,
        "cpu_max_batch_size": 4, "n_ctx": 1024, "max_queue_size": 16,
        # reconsider an offloaded decode every 8 tokens, so some move back to the GPU within 24
        "token_limit_min": 8, "token_limit_max": 8}


def counting_prompt(i: int) -> str:
    """A prompt whose greedy continuation is sharply peaked: the model's next tokens are robust to rounding."""
    start = 10 * i + 3
    return ", ".join(str(start + k) for k in range(6)) + ","


@pytest.fixture(scope="module")
def auto(default_model, tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("auto"), {"model": str(default_model), **AUTO})
    yield d
    assert d.stop() == 0, d.log()


async def _complete(session, url: str, prompt: str, max_tokens: int, stream: bool, mode: str | None = None) -> dict:
    """One greedy completion; streamed ones are put back together into the shape of a JSON answer."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if mode:
        body["syshax"] = {"mode": mode}
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if not stream:
            out = await resp.json()
            out["header_route"] = resp.headers.get("X-Syshax-Route")
            return out
        assert resp.status == 200, await resp.text()
        text, route, n = "", None, 0
        async for line in resp.content:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            text += chunk["choices"][0]["text"]
            route = chunk.get("syshax", route)
        return {"choices": [{"text": text}], "syshax": route, "header_route": resp.headers.get("X-Syshax-Route")}


def run_all(url: str, prompts: list[str], max_tokens: int, stream=lambda i: False, mode: str | None = None):
    async def go():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            return await asyncio.gather(*(_complete(session, url, p, max_tokens, stream(i), mode)
                                          for i, p in enumerate(prompts)))
    return asyncio.run(asyncio.wait_for(go(), 300))


def reference(url: str, prompts: list[str], max_tokens: int) -> list[str]:
    """Each prompt alone on the CPU worker: what every route must give back."""
    return [run_all(url, [p], max_tokens, mode="cpu")[0]["choices"][0]["text"] for p in prompts]


def test_saturated_gpu_offloads_decodes_and_every_text_is_right(auto):
    prompts = [counting_prompt(i) for i in range(12)]
    before = auto.status()
    answers = run_all(auto.url, prompts, 24, stream=lambda i: i % 2 == 1)
    expected = reference(auto.url, prompts, 24)
    routes = [a["syshax"]["route"] for a in answers]
    assert [a["choices"][0]["text"] for a in answers] == expected, routes
    assert all(a["header_route"] == a["syshax"]["route"] for a in answers)
    assert {"gpu", "hetero"} <= set(routes), routes
    for a in answers:
        if a["syshax"]["route"] == "hetero":
            assert "offloading decode to the CPU" in a["syshax"]["reason"]
    moved = [a for a in answers if a["syshax"].get("moved_to") == "gpu"]
    assert moved, "with a token limit of 8, some offloaded decodes should have moved back to the GPU"

    st = auto.status()
    assert st["routes"]["gpu"] - before["routes"].get("gpu", 0) == routes.count("gpu")
    assert st["routes"]["hetero"] - before["routes"].get("hetero", 0) == routes.count("hetero")
    decider = st["auto"]
    assert decider["moved_to_gpu"] >= len(moved) and decider["reconsidered"] >= decider["moved_to_gpu"]
    assert decider["thresholds"]["max_num_seqs"] == 2 and decider["thresholds"]["cpu_max_batch_size"] == 4
    last = decider["last"]
    assert last["route"] in ("gpu", "hetero", "refuse") and {"running", "waiting", "kv_usage"} <= set(last["gpu"])
    assert st["kv"]["records_read"] > 0 and not st["kv"]["fallbacks"]
    import urllib.request

    with urllib.request.urlopen(f"{auto.url}/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    assert f'syshax_requests_routed_total{{route="hetero"}} {float(st["routes"]["hetero"])}' in metrics
    assert f"syshax_auto_moved_to_gpu_total {float(decider['moved_to_gpu'])}" in metrics
    settle(auto)


def test_a_quiet_daemon_keeps_everything_on_the_gpu(auto):
    settle(auto)
    for i in range(3):
        (answer,) = run_all(auto.url, [counting_prompt(i)], 8)
        assert answer["syshax"] == {"route": "gpu", "reason": "GPU has room", "decided_by": "thresholds"}


def test_mode_switches_at_run_time_and_per_request(auto, tmp_path):
    (cpu,) = run_all(auto.url, [counting_prompt(1)], 4, mode="cpu")
    assert cpu["syshax"] == {"route": "cpu"} and cpu["header_route"] == "cpu"
    (hetero,) = run_all(auto.url, [counting_prompt(1)], 4, mode="hetero")
    assert hetero["syshax"]["route"] == "hetero"
    status, err = http_json(f"{auto.url}/v1/completions",
                            {"model": MODEL_NAME, "prompt": "x", "syshax": {"mode": "warp"}})
    assert status == 400 and err["error"]["param"] == "syshax.mode"
    assert auto.status()["modes"] == {"cpu": "available", "gpu": "available", "hetero": "available",
                                      "auto": "available"}


def test_a_cpu_daemon_refuses_routes_it_cannot_serve(daemon):
    status, err = http_json(f"{daemon.url}/v1/completions",
                            {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2, "syshax": {"mode": "auto"}})
    assert status == 400 and err["error"]["param"] == "syshax.mode"
    assert "auto needs the GPU engine" in err["error"]["message"] and "restart" in err["error"]["message"]
    status, ok = http_json(f"{daemon.url}/v1/completions", {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2})
    assert status == 200 and ok["syshax"] == {"route": "cpu"}


def test_overload_beyond_the_queue_is_refused_with_429_and_the_daemon_serves_on(auto):
    settle(auto)

    async def go():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            async def one(i):
                body = {"model": MODEL_NAME, "prompt": f"Hello {i}", "max_tokens": 16, "temperature": 0}
                async with session.post(f"{auto.url}/v1/completions", json=body) as resp:
                    await resp.read()
                    return resp.status, resp.headers.get("Retry-After")
            return await asyncio.gather(*(one(i) for i in range(200)))

    results = asyncio.run(asyncio.wait_for(go(), 180))  # none hangs
    statuses = [s for s, _ in results]
    assert set(statuses) <= {200, 429}, statuses
    # 2 GPU slots + 4 CPU slots + a queue of 16 hold 22 at once; the rest are refused, with a Retry-After
    assert 22 <= statuses.count(200) < 200 and statuses.count(429) > 100
    assert all(retry for s, retry in results if s == 429)
    st = settle(auto)
    assert st["refused"]["overloaded"] >= statuses.count(429)
    (after,) = run_all(auto.url, [counting_prompt(0)], 8)
    assert after["choices"][0]["text"].strip().startswith("9, 10")


def test_while_the_gpu_engine_restarts_auto_serves_on_the_cpu(auto):
    import os
    import signal

    settle(auto)
    (gpu0,) = [w for w in auto.status()["workers"] if w["name"] == "gpu0"]
    os.kill(gpu0["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while next(w for w in auto.status()["workers"] if w["name"] == "gpu0")["state"] == "ready":
        assert time.monotonic() < deadline, "the daemon did not notice gpu0's death"
        time.sleep(0.01)
    (answer,) = run_all(auto.url, [counting_prompt(0)], 8)  # within worker_restart_delay (1 s)
    assert answer["syshax"]["route"] == "cpu" and "GPU engine is not ready" in answer["syshax"]["reason"]
    assert answer["choices"][0]["text"].strip().startswith("9, 10")
    auto.wait_healthy()
    (answer,) = run_all(auto.url, [counting_prompt(0)], 8)
    assert answer["syshax"]["route"] == "gpu"


def test_a_request_that_waits_past_request_timeout_gets_a_clean_503(default_model, tmp_path):
    d = start_daemon(tmp_path, {"model": str(default_model), "cpu_max_batch_size": 1, "request_timeout": 1.0})
    try:
        async def go():
            async with aiohttp.ClientSession() as session:
                long = {"model": MODEL_NAME, "prompt": "Tell me a story.", "max_tokens": 600, "ignore_eos": True}
                first = asyncio.ensure_future(session.post(f"{d.url}/v1/completions", json=long))
                await asyncio.sleep(0.3)
                async with session.post(f"{d.url}/v1/completions", json=long | {"max_tokens": 4}) as resp:
                    second = resp.status, await resp.json()
                async with await first as resp:
                    return second, (resp.status, await resp.json())

        (status, err), (first_status, first) = asyncio.run(asyncio.wait_for(go(), 120))
        assert status == 503 and err["error"]["code"] == "timeout" and "request_timeout" in err["error"]["message"]
        assert first_status == 200 and first["usage"]["completion_tokens"] == 600  # the one running is untouched
        st = settle(d)
        assert st["in_flight"] == 0  # the one that timed out left no sequence behind
    finally:
        assert d.stop() == 0


def settle(d, timeout: float = 30.0) -> dict:
    """The status once nothing is in flight any more (cancelled requests are freed asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        st = d.status()
        if st["in_flight"] == 0 or time.monotonic() > deadline:
            assert st["in_flight"] == 0, st
            return st
        time.sleep(0.1)


def test_a_request_asking_for_logprobs_is_the_deciders_when_the_gpu_engine_hands_them_on(auto):
    """This daemon's "GPU" engine is llama.cpp, whose plugin declares that a prompt it hands on keeps its logprobs
    (handed_on_logprobs): auto leaves such a request to the decider, and its logprobs are whole on any route. (With
    vLLM, which does not declare it, auto keeps the request on the CPU: test_vllm.py's auto test.)"""
    ask = {"model": MODEL_NAME, "prompt": "1, 2, 3,", "max_tokens": 3, "temperature": 0, "logprobs": 2, "echo": True}
    status, body = http_json(f"{auto.url}/v1/completions", ask)
    assert status == 200, body
    assert body["syshax"]["route"] in ("gpu", "hetero") and "logprobs" not in body["syshax"]["reason"]
    status, on_cpu = http_json(f"{auto.url}/v1/completions", ask | {"syshax": {"mode": "cpu"}})
    assert status == 200, on_cpu
    got, want = body["choices"][0]["logprobs"], on_cpu["choices"][0]["logprobs"]
    assert got["tokens"] == want["tokens"] and len(got["token_logprobs"]) == len(want["token_logprobs"])
    assert got["token_logprobs"][0] is None and all(lp is not None for lp in got["token_logprobs"][1:])
