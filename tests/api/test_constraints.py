"""A drop-in for vLLM's and llama-server's clients: their constraint fields hold, and no field is silently ignored.

Each constraint form is sent as those servers' clients send it, on 20 prompts, to a real daemon; every answer must
hold the constraint (jsonschema validates, the regex matches the whole output, the output is one of the choices).
An unknown field, at any depth, is a 400 naming it; the harmless fields common clients send are accepted.
"""

from __future__ import annotations

import concurrent.futures
import json
import re

import jsonschema
import openai
import pytest

from conftest import MODEL_NAME, http_json, start_daemon

PROMPTS = [f"Describe item number {i} of a shop inventory: {thing}." for i, thing in enumerate(
    ["a red bicycle", "a green lamp", "an old map", "a steel kettle", "a wool hat", "a glass vase", "a pine table",
     "a leather bag", "a paper kite", "a brass key", "a silk scarf", "a clay pot", "a tin robot", "a cotton shirt",
     "a stone bowl", "a copper pan", "a plastic cup", "a wooden spoon", "a rubber duck", "a silver ring"])]

SCHEMA = {  # the case: the schema allows at most 3 tags, and bounds every string
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
                   "in_stock": {"type": "boolean"}},
    "required": ["name", "tags", "in_stock"],
    "additionalProperties": False,
}
REGEX = r"[A-Z][a-z]{2,8}-\d{3}"
CHOICES = ["positive", "negative", "neutral"]
GBNF = 'root ::= "(" [0-9] [0-9]? ("," [0-9] [0-9]?){0,3} ")"'
GBNF_MATCH = r"\(\d\d?(,\d\d?){0,3}\)"


def valid_json(text: str) -> bool:
    jsonschema.validate(json.loads(text), SCHEMA)
    return True


# (the fields as the peer's clients send them, the check every output must pass)
FORMS = {
    "response_format json_object + schema (llama-server, instructor JSON_SCHEMA)":
        ({"response_format": {"type": "json_object", "schema": SCHEMA}}, valid_json),
    "guided_json (vLLM)": ({"guided_json": SCHEMA}, valid_json),
    "guided_json as JSON text (vLLM)": ({"guided_json": json.dumps(SCHEMA)}, valid_json),
    "guided_choice (vLLM)": ({"guided_choice": CHOICES}, lambda t: t in CHOICES),
    "guided_regex (vLLM)": ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t) is not None),
    "guided_grammar (vLLM)": ({"guided_grammar": GBNF}, lambda t: re.fullmatch(GBNF_MATCH, t) is not None),
    "structured_outputs.choice (vLLM)": ({"structured_outputs": {"choice": CHOICES}}, lambda t: t in CHOICES),
    "structured_outputs.json (vLLM)": ({"structured_outputs": {"json": SCHEMA}}, valid_json),
    "structured_outputs.regex (vLLM)":
        ({"structured_outputs": {"regex": REGEX}}, lambda t: re.fullmatch(REGEX, t) is not None),
    "structured_outputs.grammar (vLLM)":
        ({"structured_outputs": {"grammar": GBNF}}, lambda t: re.fullmatch(GBNF_MATCH, t) is not None),
    "grammar (llama-server)": ({"grammar": GBNF}, lambda t: re.fullmatch(GBNF_MATCH, t) is not None),
    "json_schema (llama-server)": ({"json_schema": SCHEMA}, valid_json),
}


@pytest.fixture(scope="module")
def cpu(default_model, tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("constraints"), {"model": str(default_model), "model_name": MODEL_NAME})
    yield d
    assert d.stop() == 0


def client_of(d) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.base_url, api_key="x", max_retries=0, timeout=300)


def run_form(d, extra: dict, check, prompts=PROMPTS, chat=True) -> list[str]:
    client = client_of(d)

    def one(prompt: str) -> str:
        if chat:
            r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": prompt}],
                                               max_tokens=200, temperature=0.7, seed=7, extra_body=extra)
            return r.choices[0].message.content
        return client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=200, temperature=0.7, seed=7,
                                         extra_body=extra).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outputs = list(pool.map(one, prompts))
    bad = []
    for text in outputs:
        try:
            ok = check(text)
        except (ValueError, jsonschema.ValidationError):
            ok = False
        if not ok:
            bad.append(text)
    assert not bad, f"{len(bad)} of {len(outputs)} outputs break the constraint: {bad[:3]}"
    return outputs


@pytest.mark.parametrize("form", list(FORMS))
def test_every_constraint_form_holds_on_20_prompts(cpu, form):
    extra, check = FORMS[form]
    outputs = run_form(cpu, extra, check)
    if check is valid_json:  # not the degenerate answer the issue saw: an object with its properties
        assert all(set(json.loads(t)) == {"name", "tags", "in_stock"} for t in outputs)


def test_constraints_hold_on_completions_too(cpu):
    run_form(cpu, {"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t) is not None, PROMPTS[:8], chat=False)
    run_form(cpu, {"guided_choice": CHOICES}, lambda t: t in CHOICES, PROMPTS[:8], chat=False)


def test_a_streamed_constrained_answer_holds(cpu):
    stream = client_of(cpu).chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=200, stream=True,
        extra_body={"guided_json": SCHEMA})
    assert valid_json("".join(c.choices[0].delta.content or "" for c in stream if c.choices))


@pytest.mark.parametrize("extra, param", [
    ({"guided_choice": ["a"], "grammar": 'root ::= "a"'}, "grammar"),  # two forms: which one holds is unclear
    ({"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}}, "guided_json"),
    ({"guided_regex": r"(?=a)b"}, "guided_regex"),  # a lookahead is no grammar
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_regex": 5}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", 1]}, "guided_choice"),
    ({"guided_grammar": 'start ::= "a"'}, "guided_grammar"),  # no root rule
    ({"grammar": 'root ::= "a'}, "grammar"),  # llama.cpp cannot parse it: the engine says so, naming the field
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": {"type": "integer", "minimum": 3}}, "guided_json"),  # the message names guided_json.minimum
    ({"json_schema": {"type": "object", "not": {}}}, "json_schema"),
    ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"choices": ["a"]}}, "structured_outputs.choices"),
    ({"response_format": {"type": "json_object", "schema": {"type": "string", "pattern": "a"}}},
     "response_format.schema"),
])
def test_a_constraint_that_cannot_hold_is_a_400_naming_the_field(cpu, extra, param):
    status, body = http_json(f"{cpu.base_url}/chat/completions", {
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4} | extra)
    assert status == 400, body
    assert body["error"]["param"] == param, body
    if "minimum" in json.dumps(extra):
        assert "'guided_json.minimum'" in body["error"]["message"]


@pytest.mark.parametrize("grammar", [r'root ::= [^\x00-\U0010FFFF]', r'root ::= "ab" [^\x00-\U0010FFFF]'])
def test_a_grammar_with_no_way_on_ends_the_request_not_the_worker(cpu, grammar):
    """A client's grammar may reach a point where it allows no token; llama.cpp would abort the process in the
    grammar's accept (a C++ throw), so the engine checks the sampled token first and ends that request alone."""
    pid = cpu.status()["workers"][0]["pid"]
    status, body = http_json(f"{cpu.base_url}/chat/completions", {
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "grammar": grammar})
    if grammar.startswith('root ::= "ab"'):  # after a token: the answer so far cannot be taken back
        assert status == 500 and "allows no token" in body["error"]["message"] and "'grammar'" in body["error"]["message"]
    else:  # nothing generated yet: the client's constraint is at fault, and the 400 names it
        assert status == 400 and body["error"]["param"] == "grammar" and "allows no first token" in body["error"]["message"]
    worker = cpu.status()["workers"][0]
    assert worker["pid"] == pid and worker["restarts"] == 0
    assert http_json(f"{cpu.base_url}/chat/completions", CHAT)[0] == 200


# --- no field silently ignored ---------------------------------------------------------------------------


CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("body, param", [
    (CHAT | {"guided_decoding": {"x": 1}}, "guided_decoding"),
    (CHAT | {"functions": [{"name": "f"}]}, "functions"),  # legacy function calling: use tools
    (CHAT | {"typical_p": 0.5}, "typical_p"),  # llama-server's sampler that this server does not have
    (CHAT | {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": True,
                                                                         "schemaa": {}}}},
     "response_format.json_schema.schemaa"),
    (CHAT | {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    (CHAT | {"tools": [TOOL | {"function": TOOL["function"] | {"returns": "str"}}]}, "tools[0].function.returns"),
    (CHAT | {"tools": [TOOL | {"cache_control": {"type": "ephemeral"}}]}, "tools[0].cache_control"),
    (CHAT | {"messages": [{"role": "user", "content": "hi", "cache_control": {"type": "ephemeral"}}]},
     "messages[0].cache_control"),
    (CHAT | {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "detail": "x"}]}]},
     "messages[0].content[0].detail"),
    (CHAT | {"syshax": {"mode": "cpu", "node": 1}}, "syshax.node"),
    ({"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 4, "n_predict": 4}, "n_predict"),
])
def test_an_unknown_field_at_any_depth_is_a_400_naming_it(cpu, body, param):
    path = "/completions" if "prompt" in body else "/chat/completions"
    status, answer = http_json(cpu.base_url + path, body)
    assert status == 400 and answer["error"]["code"] == "unknown_parameter", answer
    assert answer["error"]["param"] == param and param in answer["error"]["message"]


def test_harmless_fields_and_peer_switches_at_their_defaults_are_accepted(cpu):
    harmless = {"user": "u1", "metadata": {"k": "v"}, "store": True, "service_tier": "auto",
                "prompt_cache_key": "p", "safety_identifier": "s", "reasoning_effort": "low",
                "guided_decoding_backend": "xgrammar", "use_beam_search": False, "skip_special_tokens": True,
                "include_stop_str_in_output": False, "min_tokens": 0, "stop_token_ids": [], "modalities": ["text"],
                "unknown_but_null": None}
    status, body = http_json(f"{cpu.base_url}/chat/completions", CHAT | harmless)
    assert status == 200, body
    status, body = http_json(f"{cpu.base_url}/completions", {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2,
                                                            "user": "u1", "logit_bias": {}})
    assert status == 200, body


@pytest.mark.parametrize("field, value", [("use_beam_search", True), ("min_tokens", 3), ("stop_token_ids", [2]),
                                          ("modalities", ["text", "audio"]), ("include_stop_str_in_output", True)])
def test_a_peer_switch_asking_for_what_this_server_does_not_do_is_a_400(cpu, field, value):
    status, body = http_json(f"{cpu.base_url}/chat/completions", CHAT | {field: value})
    assert status == 400 and body["error"]["param"] == field and body["error"]["code"] == "unsupported_parameter"


def test_the_openapi_document_declares_exactly_the_fields_taken():
    """api/core/fields.py (what is refused) and api/openapi.py (what schemathesis fuzzes) name the same fields."""
    from syshaxd.api.core import fields
    from syshaxd.api.openapi import build_document

    schemas = build_document(MODEL_NAME, 4096, ["cpu"], False, False)["components"]["schemas"]
    for name, spec in (("ChatCompletionRequest", fields.CHAT), ("CompletionRequest", fields.COMPLETIONS),
                       ("ResponseRequest", fields.RESPONSES), ("MessagesRequest", fields.MESSAGES)):
        assert schemas[name]["additionalProperties"] is False
        assert set(schemas[name]["properties"]) == set(spec.keys) | set(fields.HARMLESS) | set(fields.DEFAULT_ONLY)


def test_the_daemon_still_serves_after_the_refusals(cpu):
    assert http_json(f"{cpu.base_url}/chat/completions", CHAT)[0] == 200


# --- the real clients ---------------------------------------------------------------------------------------


def test_instructor_json_schema_and_tools_modes(cpu):
    instructor = pytest.importorskip("instructor")
    from typing import Annotated

    from pydantic import BaseModel, Field, StringConstraints

    class Item(BaseModel):  # every string bounded, so that no answer runs into max_tokens
        name: str = Field(max_length=20)
        tags: list[Annotated[str, StringConstraints(max_length=10)]] = Field(max_length=3)

    for mode in (instructor.Mode.JSON_SCHEMA, instructor.Mode.TOOLS):
        client = instructor.from_openai(client_of(cpu), mode=mode)
        for prompt in PROMPTS[:5]:
            item = client.chat.completions.create(model=MODEL_NAME, response_model=Item, max_retries=0,
                                                  max_tokens=300, messages=[{"role": "user", "content": prompt}])
            assert isinstance(item, Item) and len(item.tags) <= 3


# --- hetero: the prefill engine samples the first token under the same grammar ---------------------------------


def test_constraint_forms_and_the_other_apis_hold_in_hetero_mode(default_model, tmp_path):
    d = start_daemon(tmp_path, {"model": str(default_model), "model_name": MODEL_NAME, "mode": "hetero",
                                "prefill_cpu_affinity": "0"})
    try:
        for form in ("guided_json (vLLM)", "guided_regex (vLLM)", "structured_outputs.choice (vLLM)",
                     "grammar (llama-server)", "response_format json_object + schema (llama-server, instructor "
                     "JSON_SCHEMA)"):
            extra, check = FORMS[form]
            run_form(d, extra, check, PROMPTS[:20] if form == "guided_json (vLLM)" else PROMPTS[:6])
        routed = d.status()["routes"].get("hetero", 0)
        assert routed > 0
        the_other_apis_hold_their_constraints(d)
        assert d.status()["routes"].get("hetero", 0) > routed
    finally:
        assert d.stop() == 0


def the_other_apis_hold_their_constraints(d) -> None:
    """/v1/responses' text.format and /v1/messages' forced tool, through the official clients, on d."""
    anthropic = pytest.importorskip("anthropic", reason="anthropic is in the test extras: pip install -e .[test]")
    client = client_of(d)
    for prompt in PROMPTS[:4]:
        r = client.responses.create(model=MODEL_NAME, input=prompt, max_output_tokens=200, temperature=0,
                                    text={"format": {"type": "json_schema", "name": "item", "schema": SCHEMA}})
        assert r.status == "completed", r
        jsonschema.validate(json.loads(r.output_text), SCHEMA)
    tool = {"name": "record_item", "description": "Record an inventory item", "input_schema": SCHEMA}
    messages = anthropic.Anthropic(base_url=d.url, api_key="unused", max_retries=0, timeout=120)
    for prompt in PROMPTS[4:8]:
        m = messages.messages.create(model=MODEL_NAME, max_tokens=200, tools=[tool],
                                     tool_choice={"type": "tool", "name": "record_item"},
                                     messages=[{"role": "user", "content": prompt}])
        (use,) = [block for block in m.content if block.type == "tool_use"]
        assert m.stop_reason == "tool_use" and use.name == "record_item"
        jsonschema.validate(use.input, SCHEMA)
