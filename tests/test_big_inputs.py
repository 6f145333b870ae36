"""Inputs at every size limit: each gets 200 or a 4xx naming its field, and the daemon goes on serving at once.

A prompt of megabytes, a chat of 20,000 messages, long stop strings: before the control channel
carried whole messages only, a 1 MB prompt left half a message in the worker's pipe and wedged the
worker until the heartbeat watchdog killed it, taking every other request on it along. Each input is
sent in cpu and hetero mode; after each, a good request must come back at once with the text it had
before, and no worker may have restarted.
"""

from __future__ import annotations

import time

import openai
import pytest

from conftest import MODEL_NAME, http_json, start_daemon

GOOD = "The capital of France is"
MB = 1 << 20


@pytest.fixture(scope="module", params=["cpu", "hetero"])
def served(request, default_model, tmp_path_factory):
    mode = request.param
    config = {"model": str(default_model), "model_name": MODEL_NAME, "mode": mode, "n_ctx": 1024}
    if mode == "hetero":
        config["prefill_cpu_affinity"] = "0"
    d = start_daemon(tmp_path_factory.mktemp(f"big-{mode}"), config)
    yield d
    assert d.stop() == 0, d.log()


def good_text(d) -> str:
    client = openai.OpenAI(base_url=d.base_url, api_key="x", max_retries=0, timeout=60)
    return client.completions.create(model=MODEL_NAME, prompt=GOOD, max_tokens=12, temperature=0).choices[0].text


def restarts(d) -> int:
    return sum(w["restarts"] + w["hangs"] for w in d.status()["workers"])


def words(nbytes: int) -> str:
    return ("lorem ipsum dolor sit amet " * (nbytes // 27 + 1))[:nbytes]


INPUTS = {
    "prompt 1 MB": ("completions", {"prompt": words(1 * MB), "max_tokens": 4}),
    "prompt 2 MB": ("completions", {"prompt": words(2 * MB), "max_tokens": 4}),
    "prompt 3.9 MB": ("completions", {"prompt": words(int(3.9 * MB)), "max_tokens": 4}),
    "20,000 messages": ("chat/completions", {"messages": [{"role": "user", "content": "hi"}] * 20000,
                                             "max_tokens": 4}),
    "2,048 messages": ("chat/completions", {"messages": [{"role": "user", "content": "hi"}] * 2048,
                                            "max_tokens": 4}),
    "one 1 MB message": ("chat/completions", {"messages": [{"role": "user", "content": words(MB)}], "max_tokens": 4}),
    "long stop strings": ("completions", {"prompt": GOOD, "max_tokens": 4, "stop": [words(200 * 1024)] * 4}),
    "prompt of 3000 token ids": ("completions", {"prompt": [42] * 3000, "max_tokens": 4}),
}


@pytest.mark.parametrize("name", list(INPUTS))
def test_a_big_input_is_answered_clearly_and_the_daemon_serves_on(served, name):
    endpoint, body = INPUTS[name]
    before, restarted = good_text(served), restarts(served)
    started = time.monotonic()
    status, answer = http_json(f"{served.base_url}/{endpoint}", {"model": MODEL_NAME, **body}, timeout=60)
    took = time.monotonic() - started
    assert status == 200 or 400 <= status < 500, (name, status, answer)
    if status != 200:
        assert answer["error"]["param"], answer  # names the field
    again = time.monotonic()
    assert good_text(served) == before
    assert time.monotonic() - again < 10, "the next good request was not answered at once"
    assert restarts(served) == restarted, served.log()[-3000:]
    print(f"[big inputs] {served.status()['mode']:<6} {name:<26} -> {status} "
          f"{(answer.get('error') or {}).get('code') or ''} in {took:.2f}s")
