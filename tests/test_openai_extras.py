"""OpenAI's extras on a real cpu-mode daemon through the official client: /tokenize and /detokenize, logprobs,
echo, n > 1 and prompt lists -- checked against a plain llama-cpp-python forward pass of the same GGUF."""

from __future__ import annotations

import pytest

from conftest import MODEL_NAME, http_json


# --- /tokenize and /detokenize ------------------------------------------------------------------------


def test_tokenize_and_detokenize_round_trip(daemon):
    status, body = http_json(f"{daemon.url}/tokenize", {"content": "The capital of France is"})
    assert status == 200
    assert body["count"] == len(body["tokens"]) == 5  # as test_api's usage counts it
    assert body["max_model_len"] == 4096
    status, back = http_json(f"{daemon.url}/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and back["content"] == "The capital of France is"


def test_tokenize_takes_vllm_fields_and_pieces(daemon):
    _, a = http_json(f"{daemon.url}/tokenize", {"prompt": "Hello world", "model": MODEL_NAME})
    _, b = http_json(f"{daemon.url}/tokenize", {"content": "Hello world", "with_pieces": True})
    assert [p["id"] for p in b["tokens"]] == a["tokens"]
    assert "".join(p["piece"] for p in b["tokens"]) == "Hello world"


def test_tokenize_chat_messages_as_the_engine_counts_them(client, daemon):
    messages = [{"role": "user", "content": "Say hello."}]
    _, body = http_json(f"{daemon.url}/tokenize", {"messages": messages})
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1)
    assert body["count"] == r.usage.prompt_tokens


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "content"),
    ("/tokenize", {"content": 5}, "content"),
    ("/tokenize", {"content": "x", "add_special": "yes"}, "add_special"),
    ("/tokenize", {"content": "x", "model": "nope"}, "model"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": [1, "a"]}, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
])
def test_token_endpoints_refuse_bad_bodies(daemon, path, body, param):
    status, answer = http_json(f"{daemon.url}{path}", body)
    assert status in (400, 404) and answer["error"]["param"] == param
