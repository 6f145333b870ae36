"""The OpenAPI document at /openapi.json: it matches what validate.py accepts, and schemathesis finds no 5xx.

The schemathesis run drives a real daemon with examples generated from the document
(valid bodies and, in its negative phases, invalid ones): no answer may be a 5xx,
and every answer must conform to the document (status, content type, body schema).
Generations are kept short: the daemon's default_max_tokens is small and, in the copy
of the document the run uses, so is the max_tokens maximum.
"""

from __future__ import annotations

import copy
import json
import time
import urllib.request
from collections import Counter

import pytest

from conftest import MODEL_NAME, http_json, start_daemon
from syshaxd.api.core.validate import CHAT_ROLES, INTEGER_RANGES, MAX_N, MAX_STOP, NUMBER_RANGES

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is in the test extras: pip install -e .[test]")
from hypothesis import HealthCheck, Phase, settings  # noqa: E402  (schemathesis brings hypothesis)

MAX_EXAMPLES = 50  # per operation and mode
RUN_MAX_TOKENS = 6  # the largest max_tokens the run sends
MAX_PROMPT = 64  # characters (or token ids) per prompt or message in the run
FUZZ_N_CTX = 512  # the fuzzed daemon's context: longer prompts get 400 quickly
SEEN: Counter = Counter()


def fetch_document(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/openapi.json", timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("application/json")
        return json.loads(resp.read())


# --- the document ---------------------------------------------------------------------------------


def _props(doc: dict, name: str) -> dict:
    return doc["components"]["schemas"][name]["properties"]


def _inner(schema: dict) -> dict:
    """The non-null branch of a nullable field."""
    return next(s for s in schema["anyOf"] if s.get("type") != "null") if "anyOf" in schema else schema


def test_the_document_describes_this_daemon(daemon):
    doc = fetch_document(daemon.url)
    assert doc["openapi"].startswith("3.1")
    schemathesis.openapi.from_dict(doc).validate()  # against the OpenAPI 3.1 meta-schema
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{model}", "/health", "/metrics",
            "/v1/syshax/status", "/openapi.json", "/tokenize", "/detokenize"} <= set(doc["paths"])
    # every route the daemon serves but its web page's (docs/reference/http.md lists those)
    from syshaxd.docs_reference import routes  # the daemon's app's router, built without engines

    served = {route.path for route in routes()}
    assert served - set(doc["paths"]) == {"/", "/ui/{name}", "/favicon.ico"}
    for path in ("/v1/completions", "/v1/chat/completions"):
        op = doc["paths"][path]["post"]
        assert set(op["responses"]) == {"200", "400", "401", "404", "413", "429", "500", "503"}
        assert set(op["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
        for status in ("400", "401", "404", "413", "429", "503"):
            assert op["responses"][status]["content"]["application/json"]["schema"]["$ref"].endswith("/Error")
        assert op["security"] == []  # no api_keys on this daemon
    error = doc["components"]["schemas"]["Error"]["properties"]["error"]
    assert set(error["required"]) == {"message", "type", "param", "code"}


def test_request_schemas_carry_validate_py_limits(daemon):
    doc = fetch_document(daemon.url)
    completion, chat = _props(doc, "CompletionRequest"), _props(doc, "ChatCompletionRequest")
    for props in (completion, chat):
        assert _inner(props["model"])["enum"] == [MODEL_NAME]
        for name, (low, high) in (NUMBER_RANGES | INTEGER_RANGES).items():
            assert (_inner(props[name])["minimum"], _inner(props[name])["maximum"]) == (low, high), name
        assert _inner(props["stop"])["anyOf"][1]["maxItems"] == MAX_STOP
        assert _inner(props["syshax"])["properties"]["mode"]["anyOf"][0]["enum"] == ["cpu"]  # a cpu daemon
    assert _inner(completion["max_tokens"])["maximum"] == 4096  # the daemon's n_ctx
    message = chat["messages"]["items"]
    assert message["properties"]["role"]["enum"] == list(CHAT_ROLES)
    assert doc["components"]["schemas"]["CompletionRequest"]["required"] == ["model", "prompt"]


def test_real_answers_conform_to_the_document(daemon):
    import jsonschema_rs

    doc = fetch_document(daemon.url)

    def check(name: str, instance: dict) -> None:
        schema = {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
        jsonschema_rs.validator_for(schema).validate(instance)

    status, body = http_json(f"{daemon.base_url}/completions", {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 3})
    check("Completion", body)
    status, body = http_json(f"{daemon.base_url}/chat/completions",
                             {"model": MODEL_NAME, "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]})
    check("ChatCompletion", body)
    check("ModelList", http_json(f"{daemon.base_url}/models")[1])
    check("Health", http_json(f"{daemon.url}/health")[1])
    for bad in ({"prompt": "hi", "temperature": 3}, {"prompt": ""}, {"model": "nope", "prompt": "x"}):
        check("Error", http_json(f"{daemon.base_url}/completions", {"model": MODEL_NAME} | bad)[1])


# --- schemathesis against a real daemon --------------------------------------------------------------


@pytest.fixture(scope="module")
def fuzzed(default_model, tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("schemathesis"),
                     {"model": str(default_model), "model_name": MODEL_NAME, "n_ctx": FUZZ_N_CTX,
                      "default_max_tokens": 4, "cpu_max_batch_size": 4})
    yield d
    assert d.stop() == 0, d.log()
    print(f"\n[openapi] schemathesis: {sum(SEEN.values())} requests, statuses {dict(sorted(SEEN.items()))}, "
          f"5xx seen {sum(n for s, n in SEEN.items() if s >= 500)}")


def _short_generations(doc: dict) -> dict:
    """The document with max_tokens capped low and prompts kept short, so that every request is quick.

    Only sizes are narrowed (the 413 and context limits have their own tests in test_faults.py);
    every field, type and range stays as the daemon documents it.
    """
    doc = copy.deepcopy(doc)
    schemas = doc["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = schemas[name]["properties"]
        for field in ("max_tokens", "max_completion_tokens"):
            if field in props:
                _inner(props[field])["maximum"] = RUN_MAX_TOKENS
    schemas["ChatCompletionRequest"]["required"].append("max_tokens")  # no chat falls back to the default
    for variant in schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]:
        variant["maxItems" if variant["type"] == "array" else "maxLength"] = MAX_PROMPT
        if variant["type"] == "array" and variant["items"].get("type") == "array":
            variant["items"]["maxItems"] = MAX_PROMPT
            variant["maxItems"] = 3  # a batch of prompts
        if variant["type"] == "array" and variant["items"].get("type") == "string":
            variant["items"]["maxLength"] = MAX_PROMPT
            variant["maxItems"] = 3
    for name in ("CompletionRequest", "ChatCompletionRequest"):  # choices per prompt
        _inner(schemas[name]["properties"]["n"])["maximum"] = 2
    responses, anthropic = schemas["ResponseRequest"], schemas["MessagesRequest"]
    _inner(responses["properties"]["max_output_tokens"])["maximum"] = RUN_MAX_TOKENS
    responses["required"].append("max_output_tokens")
    responses["properties"]["input"]["anyOf"][0]["maxLength"] = MAX_PROMPT
    responses["properties"]["input"]["anyOf"][1]["maxItems"] = 3
    anthropic["properties"]["max_tokens"]["maximum"] = RUN_MAX_TOKENS
    anthropic["properties"]["messages"]["maxItems"] = 3
    messages = schemas["ChatCompletionRequest"]["properties"]["messages"]
    messages["maxItems"] = 3
    content = messages["items"]["properties"]["content"]["anyOf"]
    content[0]["maxLength"] = MAX_PROMPT
    content[1]["maxItems"] = 3
    content[1]["items"]["properties"]["text"]["maxLength"] = MAX_PROMPT
    return doc


@pytest.fixture(scope="module")
def api_schema(fuzzed):
    loaded = schemathesis.openapi.from_dict(_short_generations(fetch_document(fuzzed.url)))
    loaded.config.update(base_url=fuzzed.url)
    return loaded


def _keep_short(body) -> None:
    """A negative case may carry a max_tokens above the run's cap that the daemon still accepts (up to
    its n_ctx): cap it too, so that the run stays quick. What makes the case invalid is left alone."""
    if isinstance(body, dict):
        for field in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            value = body.get(field)
            if isinstance(value, int) and not isinstance(value, bool) and RUN_MAX_TOKENS < value <= FUZZ_N_CTX:
                body[field] = RUN_MAX_TOKENS
        n = body.get("n")
        if isinstance(n, int) and not isinstance(n, bool) and 2 < n <= MAX_N:
            body["n"] = 2


# Bodies are fuzzed valid and invalid; the GET operations take no body, and any string is a valid
# path segment, so they have valid cases only.
RUNS = [(path, "POST", mode) for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
                                         "/tokenize", "/detokenize")
        for mode in ("positive", "negative")]
RUNS += [(path, "GET", "positive") for path in ("/v1/models", "/v1/models/{model}", "/v1/syshax/status", "/health",
                                                "/metrics", "/openapi.json", "/tokenizer_info")]


# schemathesis' own pytest entry (schema.parametrize with a lazy fixture) does not run under pytest 9;
# its Hypothesis strategies do, through @given, with the same checks.
@pytest.mark.parametrize("path, method, mode", RUNS)
def test_schemathesis_finds_no_5xx(api_schema, path, method, mode):
    from hypothesis import given
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (content_type_conformance, response_headers_conformance,
                                                   response_schema_conformance, status_code_conformance)

    operation = api_schema[path][method]
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
              response_schema_conformance]

    @given(case=operation.as_strategy(generation_mode=GenerationMode(mode)))
    @settings(max_examples=MAX_EXAMPLES if method == "POST" else 10, deadline=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck), database=None)
    def run(case):
        _keep_short(case.body)
        response = case.call(timeout=120)
        SEEN[response.status_code] += 1
        case.validate_response(response, checks=checks)

    run()


def test_the_daemon_is_still_serving_after_the_run(fuzzed):
    time.sleep(0.5)
    status, body = http_json(f"{fuzzed.base_url}/completions", {"model": MODEL_NAME, "prompt": "ok", "max_tokens": 2})
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    assert fuzzed.status()["in_flight"] == 0
