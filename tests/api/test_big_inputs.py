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


OVER = words(MB + 1)  # one byte past max_string_bytes' default
LONG_STRINGS = {
    "stop[1]": ("completions", {"prompt": GOOD, "stop": ["\n", OVER]}),
    "stop": ("completions", {"prompt": GOOD, "stop": OVER}),
    "prompt": ("completions", {"prompt": OVER}),
    "messages[1].content": ("chat/completions", {"messages": [{"role": "system", "content": "Be brief."},
                                                              {"role": "user", "content": OVER}]}),
    "messages[0].content[1].text": ("chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "text", "text": OVER}]}]}),
    "messages[0].name": ("chat/completions", {"messages": [{"role": "user", "content": "hi", "name": OVER}]}),
    "user": ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "user": OVER}),
    "metadata.note": ("chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                           "metadata": {"note": OVER}}),
}


@pytest.mark.parametrize("param", list(LONG_STRINGS))
def test_a_string_past_max_string_bytes_gets_400_naming_it(served, param):
    endpoint, body = LONG_STRINGS[param]
    status, answer = http_json(f"{served.base_url}/{endpoint}", {"model": MODEL_NAME, "max_tokens": 4, **body},
                               timeout=60)
    assert status == 400, answer
    error = answer["error"]
    assert (error["param"], error["code"], error["type"]) == (param, "string_above_max_length",
                                                              "invalid_request_error"), error
    assert "max_string_bytes" in error["message"] and f"{MB + 1} bytes" in error["message"], error


@pytest.mark.parametrize("name, value", [(words(MB), "a name of exactly max_string_bytes"),
                                          ("é" * (MB // 2), "a name of max_string_bytes in 2-byte characters")])
def test_a_string_of_exactly_max_string_bytes_is_taken(served, name, value):
    body = {"model": MODEL_NAME, "max_tokens": 4, "messages": [{"role": "user", "content": GOOD, "name": name}]}
    status, answer = http_json(f"{served.base_url}/chat/completions", body, timeout=60)
    assert status == 200, (value, answer)


def test_a_name_that_is_not_text_gets_400_naming_it(served):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi", "name": {"first": "x"}}]}
    status, answer = http_json(f"{served.base_url}/chat/completions", body)
    assert (status, answer["error"]["param"], answer["error"]["code"]) == (400, "messages[0].name", "invalid_type")
