"""A user's session with a real syshaxd in cpu mode, through the official openai client."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import urllib.request

import openai
import pytest

from conftest import MODEL_NAME, disconnect_mid_stream, http_json, wait_for


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME


def test_health_is_ok_once_loaded(daemon):
    status, body = http_json(f"{daemon.url}/health")
    assert status == 200 and body["status"] == "ok"


def test_completion_counts_usage(client):
    r = client.completions.create(model=MODEL_NAME, prompt="The capital of France is", max_tokens=12, temperature=0)
    choice = r.choices[0]
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert choice.text and choice.finish_reason == "length"
    assert r.usage.prompt_tokens == 5  # as llama.cpp tokenizes it (no BOS for SmolLM2)
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == 17


def test_completion_default_max_tokens_is_16(client):
    r = client.completions.create(model=MODEL_NAME, prompt="Count: 1, 2, 3,", temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16


def test_chat_uses_the_models_template(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Say hello."}],
                                       max_tokens=20, temperature=0)
    assert r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content.strip()
    # SmolLM2's template adds its default system prompt: far more tokens than the two words
    assert r.usage.prompt_tokens > 20
    assert r.choices[0].finish_reason in ("stop", "length")


def test_chat_stops_at_end_of_turn(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "What is the capital of France?"}],
                                       max_tokens=200, temperature=0)
    assert r.choices[0].finish_reason == "stop"
    assert "<|im_end|>" not in r.choices[0].message.content
    assert r.usage.completion_tokens < 200


def test_streaming_completion_matches_plain(client):
    kw = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=24, temperature=0)
    plain = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == plain
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].usage.completion_tokens == 24 and chunks[-1].usage.prompt_tokens == 4


def test_streaming_chat_matches_plain(client):
    kw = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Name three colours."}], max_tokens=30, temperature=0)
    plain = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == plain
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_sse_wire_format_ends_with_done(daemon):
    body = json.dumps({"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 3, "stream": True}).encode()
    req = urllib.request.Request(f"{daemon.base_url}/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        raw = resp.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    for e in events[:-1]:
        json.loads(e[len("data: "):])


def test_stop_string_cuts_the_text(client):
    kw = dict(model=MODEL_NAME, prompt="The capital of France is", max_tokens=30, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    words = full.split()
    stop = words[len(words) // 2]
    expected = full[: full.index(stop)]
    for stream in (False, True):
        if stream:
            text = "".join(c.choices[0].text for c in client.completions.create(stream=True, stop=[stop], **kw))
        else:
            r = client.completions.create(stop=stop, **kw)
            assert r.choices[0].finish_reason == "stop"
            text = r.choices[0].text
        assert text == expected, (stream, stop, full)


def test_seeded_sampling_is_repeatable(client):
    kw = dict(model=MODEL_NAME, prompt="My favourite animal is", max_tokens=16, temperature=0.9, top_p=0.9,
              seed=1234, extra_body={"top_k": 40})
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b


def test_token_id_prompt(client):
    by_text = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=8, temperature=0)
    ids = [6403, 1980, 253, 655]  # "Once upon a time" in SmolLM2's vocabulary
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.usage.prompt_tokens == 4
    assert by_ids.choices[0].text == by_text.choices[0].text


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "hi", "temperature": 5}, "temperature"),
        ({"prompt": "hi", "temperature": "hot"}, "temperature"),
        ({"prompt": "hi", "top_p": 1.5}, "top_p"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": -3}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 10**9}, "max_tokens"),
        ({"prompt": "hi", "n": 0}, "n"),
        ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"prompt": "hi", "stop": 7}, "stop"),
        ({"prompt": "hi", "logprobs": 21}, "logprobs"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": ["one", 2]}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "word " * 5000}, "prompt"),
    ],
)
def test_bad_completion_bodies_get_openai_errors(daemon, body, param):
    status, answer = http_json(f"{daemon.base_url}/completions", {"model": MODEL_NAME} | body)
    assert status == 400, answer
    err = answer["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": "hello"}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         "messages[0].content"),
    ],
)
def test_bad_chat_bodies_get_openai_errors(daemon, body, param):
    status, answer = http_json(f"{daemon.base_url}/chat/completions", {"model": MODEL_NAME} | body)
    assert status == 400, answer
    assert answer["error"]["param"] == param


def test_client_sees_errors_as_exceptions(client):
    with pytest.raises(openai.NotFoundError) as exc:
        client.completions.create(model="gpt-5", prompt="hi")
    assert exc.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], n=17)
    assert exc.value.body["param"] == "n"


def _raw_post(daemon, path: str, data: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(f"{daemon.url}{path}", data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_invalid_json_invalid_utf8_and_huge_bodies(daemon):
    assert _raw_post(daemon, "/v1/completions", b"{not json")[0] == 400
    assert _raw_post(daemon, "/v1/completions", b'{"model": "\xff\xfe"}')[1]["error"]["code"] == "invalid_json"
    assert _raw_post(daemon, "/v1/completions", b"[1, 2]")[0] == 400
    status, body = _raw_post(daemon, "/v1/completions", b'{"prompt": "' + b"a" * (5 * 1024 * 1024) + b'"}')
    assert status == 413 and body["error"]["code"] == "request_too_large"


def test_unknown_paths_and_methods_answer_in_openai_shape(daemon):
    status, body = http_json(f"{daemon.url}/v1/nothing-here")
    assert status == 404 and "error" in body
    req = urllib.request.Request(f"{daemon.base_url}/completions", method="GET")
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(req, timeout=10)
    assert exc.value.code == 405 and "error" in json.loads(exc.value.read())


def test_unknown_fields_are_refused_naming_them(client):
    """An unknown field is a 400 naming it, never silently ignored (api/core/fields.py; tests/api/test_constraints.py
    goes deeper); null is an absent field, and the benchmark clients' min_tokens holds with ignore_eos."""
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2, extra_body={"frobnicate": True})
    assert err.value.body["param"] == "frobnicate" and err.value.body["code"] == "unknown_parameter"
    r = client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2,
                                  extra_body={"frobnicate": None, "ignore_eos": True, "min_tokens": 2})
    assert r.usage.completion_tokens == 2
    with pytest.raises(openai.BadRequestError, match="ignore_eos"):
        client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2, extra_body={"min_tokens": 2})


def test_daemon_still_serves_after_bad_input(client):
    r = client.completions.create(model=MODEL_NAME, prompt="Still alive?", max_tokens=3, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3


def test_disconnect_mid_stream_frees_the_slot(daemon):
    disconnect_mid_stream(daemon, "/v1/completions", {"model": MODEL_NAME, "prompt": "Tell me a very long story.",
                                                      "max_tokens": 3000, "stream": True, "ignore_eos": True})


def test_a_client_that_leaves_an_answer_without_a_stream_frees_the_slot(daemon):
    """Tokens that keep coming do not hide a client that left a whole-answer request: its sequence ends soon, long
    before its max_tokens (it did not, when the daemon looked only while no token came)."""
    body = json.dumps({"model": MODEL_NAME, "prompt": "Tell me a very long story.", "max_tokens": 3000,
                       "ignore_eos": True}).encode()
    before = len(daemon.log())
    with socket.create_connection(("127.0.0.1", daemon.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        wait_for(lambda: daemon.status()["workers"][0]["stats"]["running"] == 1, 30, "the request to run")
    wait_for(lambda: "client left before the answer was ready" in daemon.log()[before:], 15, "the daemon to notice")
    wait_for(lambda: daemon.status()["workers"][0]["stats"]["running"] == 0, 15, "the slot to be freed")


def test_concurrent_requests_all_complete(client):
    prompts = [f"Write a sentence about the number {i}." for i in range(12)]
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        results = list(pool.map(lambda p: client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=20,
                                                                     temperature=0, extra_body={"ignore_eos": True}),
                                prompts))
    assert [r.usage.completion_tokens for r in results] == [20] * 12
