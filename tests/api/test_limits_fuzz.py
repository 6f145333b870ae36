"""Requests generated near every limit: each gets 200 or a 4xx in OpenAI's error shape, never a 5xx.

Where schemathesis fuzzes the API from its document, this file aims Hypothesis at the edges of the
limits themselves, on a real daemon whose limits are small so the edges are cheap to reach: the body
just under and over max_body_bytes, prompts near n_ctx tokens, max_tokens near the context left,
messages lists near max_messages, stop lists near 4 entries, strings near max_string_bytes (in 1- to
4-byte characters), odd Unicode (lone surrogates, NUL, combining marks) and wrong types at any depth.
Where the size decides the answer, the answer must be the one the size calls for. At the end no
worker may have restarted and a known request must still give the text it gave at the start.
"""

from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from conftest import MODEL_NAME, http_json, start_daemon

MAX_BODY = 64 << 10
N_CTX = 128
MAX_MESSAGES = 8
MAX_STRING = 4096
MAX_STOP = 4
GOOD = {"model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}

FUZZ = settings(max_examples=10, deadline=None, derandomize=True, database=None,
                phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def small(default_model, tmp_path_factory):
    """A daemon whose limits are all small, and what its known request answers before any fuzzing."""
    d = start_daemon(tmp_path_factory.mktemp("limits-fuzz"), {
        "model": str(default_model), "model_name": MODEL_NAME, "n_ctx": N_CTX, "max_body_bytes": MAX_BODY,
        "max_messages": MAX_MESSAGES, "max_string_bytes": MAX_STRING, "default_max_tokens": 4})
    d.known = known_text(d)
    yield d
    assert d.stop() == 0, d.log()


def known_text(d) -> str:
    status, body = http_json(f"{d.base_url}/completions", GOOD, timeout=60)
    assert status == 200, body
    return body["choices"][0]["text"]


def restarts(d) -> int:
    return sum(w["restarts"] + w["hangs"] for w in d.status()["workers"])


def post(d, endpoint: str, body: dict | bytes) -> tuple[int, dict]:
    """Send one body (a dict, or raw bytes as they are); the status and the JSON answer or the stream's events."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(f"{d.base_url}/{endpoint}", data=raw, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            text = resp.read()
            if resp.headers["Content-Type"].startswith("text/event-stream"):
                events = [line[6:] for line in text.decode().split("\n\n") if line.startswith("data: ")]
                assert events and events[-1] == "[DONE]", text[-500:]
                chunks = [json.loads(e) for e in events[:-1]]
                assert not any("error" in c for c in chunks), chunks
                return resp.status, {"stream": chunks}
            return resp.status, json.loads(text)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def check(status: int, answer: dict) -> dict | None:
    """The answer is a 200 or a 4xx in OpenAI's error shape that names its field; the error, if any."""
    assert status == 200 or 400 <= status < 500, (status, answer)
    if status == 200:
        return None
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and len(error["message"]) > 20, error
    assert error["type"] == "invalid_request_error" and error["code"], error
    if status == 400 and error["code"] != "invalid_json":  # a body that is not JSON has no field to name
        assert isinstance(error["param"], str) and error["param"], error
    return error


def completion(**fields) -> dict:
    return {"model": MODEL_NAME, "max_tokens": 2} | fields


def chat(messages, **fields) -> dict:
    return {"model": MODEL_NAME, "max_tokens": 2, "messages": messages} | fields


# --- the body --------------------------------------------------------------------------------------

def padded(size: int) -> bytes:
    """A good completions body of exactly size bytes: strings under max_string_bytes, then spaces."""
    chunk, chunks = "x" * (MAX_STRING - 8), []
    # padded in `metadata`, a field accepted and not used (api/core/fields.py HARMLESS): an unknown one is a 400
    while len(json.dumps(completion(prompt="Hello", metadata={"pad": chunks + [chunk]}))) <= size:
        chunks.append(chunk)
    raw = json.dumps(completion(prompt="Hello", metadata={"pad": chunks})).encode()
    return raw + b" " * (size - len(raw))  # JSON allows trailing whitespace


@FUZZ
@given(delta=st.integers(-3, 3) | st.sampled_from([-4096, -1, 0, 1, 4096]))
def test_bodies_near_max_body_bytes(small, delta):
    raw = padded(MAX_BODY + delta)
    assert len(raw) == MAX_BODY + delta
    status, answer = post(small, "completions", raw)
    error = check(status, answer)
    if delta > 0:
        assert (status, error["code"]) == (413, "request_too_large"), answer
        assert str(MAX_BODY) in error["message"]
    else:
        assert status == 200, answer


# --- the context -----------------------------------------------------------------------------------

@FUZZ
@given(n=st.integers(N_CTX - 4, N_CTX + 4), token=st.integers(0, 48000), max_tokens=st.integers(1, 3) | st.none())
def test_token_prompts_near_n_ctx(small, n, token, max_tokens):
    status, answer = post(small, "completions", completion(prompt=[token] * n, max_tokens=max_tokens))
    error = check(status, answer)
    wanted = 16 if max_tokens is None else max_tokens  # completions' default, as OpenAI's
    if n + wanted <= N_CTX:
        assert status == 200, answer
        assert answer["usage"]["prompt_tokens"] == n
    else:
        assert (status, error["code"]) == (400, "context_length_exceeded"), answer
        assert error["param"] in ("prompt", "max_tokens")


@FUZZ
@given(n=st.integers(N_CTX - 6, N_CTX - 1), over=st.integers(-2, 2))
def test_max_tokens_near_the_context_left(small, n, over):
    room = N_CTX - n
    max_tokens = room + over
    status, answer = post(small, "completions", completion(prompt=[198] * n, max_tokens=max_tokens,
                                                           ignore_eos=True))
    error = check(status, answer)
    if 1 <= max_tokens <= room:
        assert status == 200 and answer["usage"]["completion_tokens"] == max_tokens, answer
    else:
        assert status == 400 and error["param"] == "max_tokens", answer


@FUZZ
@given(words=st.integers(N_CTX - 8, N_CTX + 8), word=st.sampled_from(["hello ", "é ", "中", "😀", "\u0301a"]))
def test_text_prompts_near_n_ctx(small, words, word):
    status, answer = post(small, "completions", completion(prompt=word * words))
    error = check(status, answer)
    if status != 200:
        assert error["code"] == "context_length_exceeded" and error["param"] in ("prompt", "max_tokens"), error


# --- lists -----------------------------------------------------------------------------------------

@FUZZ
@given(n=st.integers(MAX_MESSAGES - 2, MAX_MESSAGES + 2) | st.sampled_from([0, 1, 10 * MAX_MESSAGES]),
       role=st.sampled_from(["user", "system", "assistant"]))
def test_messages_near_max_messages(small, n, role):
    status, answer = post(small, "chat/completions", chat([{"role": role, "content": "hi"}] * n))
    error = check(status, answer)
    if n == 0:
        assert (status, error["code"], error["param"]) == (400, "empty_array", "messages")
    elif n > MAX_MESSAGES:
        assert (status, error["code"], error["param"]) == (400, "array_above_max_length", "messages")
        assert str(MAX_MESSAGES) in error["message"]
    else:
        assert status == 200, answer


@FUZZ
@given(stop=st.lists(st.text(max_size=12), max_size=MAX_STOP + 2) | st.text(max_size=12))
def test_stop_lists_near_four(small, stop):
    status, answer = post(small, "completions", completion(prompt="Hello", stop=stop))
    error = check(status, answer)
    listed = [stop] if isinstance(stop, str) else stop
    if len(listed) <= MAX_STOP and all(listed):
        assert status == 200, answer
    else:
        assert (status, error["param"]) == (400, "stop"), answer


# --- strings ---------------------------------------------------------------------------------------

# where a string goes: its request, given the string; and the param its refusal names
PLACES = {
    "stop[1]": lambda s: ("completions", completion(prompt="Hello", stop=["\n", s])),
    "stop": lambda s: ("completions", completion(prompt="Hello", stop=s)),
    "prompt": lambda s: ("completions", completion(prompt=s)),
    "messages[0].content": lambda s: ("chat/completions", chat([{"role": "user", "content": s}])),
    "messages[1].content[0].text": lambda s: ("chat/completions", chat([
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": s}]}])),
    "messages[0].name": lambda s: ("chat/completions", chat([{"role": "user", "content": "hi", "name": s}])),
    "user": lambda s: ("completions", completion(prompt="Hello", user=s)),
}


@st.composite
def near_max_string(draw) -> str:
    """A string of MAX_STRING bytes give or take a few, in 1- to 4-byte UTF-8 characters."""
    char = draw(st.sampled_from(["a", "é", "中", "😀"]))
    size = MAX_STRING + draw(st.integers(-4, 4))
    return char * (size // len(char.encode())) + "a" * (size % len(char.encode()))


@FUZZ
@given(place=st.sampled_from(sorted(PLACES)), s=near_max_string())
def test_strings_near_max_string_bytes(small, place, s):
    endpoint, body = PLACES[place](s)
    status, answer = post(small, endpoint, body)
    error = check(status, answer)
    if len(s.encode()) > MAX_STRING:
        assert (status, error["code"], error["param"]) == (400, "string_above_max_length", place), answer
    elif status != 200:  # a prompt or content this long may not fit the context
        assert error["code"] == "context_length_exceeded", answer


ODD = st.text(st.characters(codec="utf-8"), min_size=1, max_size=40) | st.sampled_from(
    ["\x00", "\u200b\u200e", "e\u0301\u0301\u0301", "\U0010ffff", "\ufeff", "\r\n\r\n", "</s>", "<|im_end|>"])


@FUZZ
@given(text=ODD, where=st.sampled_from(["prompt", "content", "stop"]))
def test_odd_unicode(small, text, where):
    if where == "prompt":
        status, answer = post(small, "completions", completion(prompt=text))
    elif where == "content":
        status, answer = post(small, "chat/completions", chat([{"role": "user", "content": text}]))
    else:
        status, answer = post(small, "completions", completion(prompt="Hello", stop=text))
    check(status, answer)


@pytest.mark.parametrize("raw", [
    rb'{"model": "%s", "prompt": "\ud800", "max_tokens": 2}',
    rb'{"model": "%s", "prompt": "ok", "stop": ["\udfff"], "max_tokens": 2}',
    rb'{"model": "%s", "messages": [{"role": "user", "content": "\ud83d"}], "max_tokens": 2}',
    rb'{"model": "%s", "prompt": "\ud83d\ude00 ok", "max_tokens": 2}',
    b'{"model": "%s", "prompt": "\xff\xfe", "max_tokens": 2}',
])
def test_lone_surrogates_and_bad_utf8(small, raw):
    endpoint = "chat/completions" if b"messages" in raw else "completions"
    status, answer = post(small, endpoint, raw.replace(b"%s", MODEL_NAME.encode()))
    check(status, answer)


# --- wrong types, at any depth ---------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(2**63 - 2, 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
FIELDS = ["model", "prompt", "messages", "stop", "max_tokens", "max_completion_tokens", "temperature", "top_p",
          "top_k", "min_p", "seed", "n", "stream", "stream_options", "logit_bias", "ignore_eos", "syshax",
          "response_format", "tools", "presence_penalty", "repetition_penalty", "echo", "suffix", "logprobs"]


@settings(FUZZ, max_examples=30)
@given(endpoint=st.sampled_from(["completions", "chat/completions"]), field=st.sampled_from(FIELDS), value=JSON,
       deep=st.sampled_from([None, "role", "content", "name", 0]))
def test_wrong_types_anywhere(small, endpoint, field, value, deep):
    body = completion(prompt="Hello") if endpoint == "completions" else chat([{"role": "user", "content": "hi"}])
    if deep is not None and endpoint == "chat/completions":
        if deep == 0:
            body["messages"] = [value]
        else:
            body["messages"][0][deep] = value
    else:
        body[field] = value
    if field in ("max_tokens", "max_completion_tokens") and isinstance(value, int) and value > 8:
        body[field] = 8  # a valid length: keep the generation short
    status, answer = post(small, endpoint, body)
    check(status, answer)


# --- the limit changes live ------------------------------------------------------------------------

def reload_with(d, old: str, new: str) -> None:
    """Rewrite one line of the daemon's config, SIGHUP it, and wait until it says it applied the change."""
    config = d.log_path.with_suffix(".toml")  # start_daemon writes the config beside the log
    config.write_text(config.read_text().replace(old, new))
    key, before, after = old.split(" = ")[0], old.split(" = ")[1], new.split(" = ")[1]
    d.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while f"applied {key} {before} -> {after}" not in d.log():
        assert time.monotonic() < deadline, d.log()[-2000:]
        time.sleep(0.1)


def test_max_string_bytes_changes_live(small):
    body = completion(prompt="Hello", stop=["a" * (MAX_STRING + 100)])
    assert post(small, "completions", body)[0] == 400
    reload_with(small, f"max_string_bytes = {MAX_STRING}", f"max_string_bytes = {2 * MAX_STRING}")
    try:
        assert post(small, "completions", body)[0] == 200
    finally:
        reload_with(small, f"max_string_bytes = {2 * MAX_STRING}", f"max_string_bytes = {MAX_STRING}")
    assert post(small, "completions", body)[0] == 400


# --- afterwards ------------------------------------------------------------------------------------

def test_no_worker_restarted_and_the_known_request_gives_the_same_text(small):
    assert restarts(small) == 0, small.log()[-3000:]
    assert known_text(small) == small.known
    assert small.status()["in_flight"] == 0
