"""The Anthropic Messages API (POST /v1/messages, /v1/messages/count_tokens) against a real daemon, through the
official anthropic client: text, system, sampling, stop sequences, stream events, tool_use / tool_result with
every tool_choice, output_config.format, and errors in Anthropic's shape naming the field.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import jsonschema
import pytest

from conftest import MODEL_NAME, disconnect_mid_stream, start_daemon
from test_structured import CASES

anthropic = pytest.importorskip("anthropic", reason="anthropic is in the test extras: pip install -e .[test]")

KEY = "sk-messages-test"
WEATHER = {"name": "get_weather", "description": "The current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                             "unit": {"enum": ["celsius", "fahrenheit"]}},
                            "required": ["city", "unit"], "additionalProperties": False}}
ADD = {"name": "add", "description": "Add two integers",
       "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                        "required": ["a", "b"], "additionalProperties": False}}
SCHEMAS = {t["name"]: t["input_schema"] for t in (WEATHER, ADD)}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
def client(daemon):
    return anthropic.Anthropic(base_url=daemon.url, api_key="unused", max_retries=0, timeout=120)


def create(client, temperature=0, **kw):
    """messages.create, greedy unless told; newer SDKs send the sampling fields (which the API still takes)
    only as extra_body."""
    extra = {"temperature": temperature} | kw.pop("extra_body", {})
    return client.messages.create(**({"model": MODEL_NAME, "max_tokens": 24} | kw), extra_body=extra)


def post(daemon, body: dict, path: str = "/v1/messages", key: str = "unused") -> tuple[int, dict]:
    req = urllib.request.Request(f"{daemon.url}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "X-Api-Key": key})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def named(answer: dict, field: str) -> bool:
    """Anthropic's error has no param: its message names the field ('field' in it, or "field: ..." first)."""
    message = answer["error"]["message"]
    return f"'{field}" in message or message.startswith(f"{field}: ")


def the_tool_use(m, names=tuple(SCHEMAS)):
    """The message's one tool_use block, its input valid against the tool's schema."""
    assert m.stop_reason == "tool_use", m
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name in names and use.id.startswith("toolu_")
    jsonschema.validate(use.input, SCHEMAS[use.name])
    return use


# --- text --------------------------------------------------------------------------------------------


def test_text_with_a_system_prompt(client):
    m = create(client, system="You are terse.", messages=[{"role": "user", "content": "Say hello."}])
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL_NAME and m.id.startswith("msg_")
    assert m.content[0].type == "text" and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    assert m.usage.input_tokens > 0 and 0 < m.usage.output_tokens <= 24


def test_system_blocks_are_the_system_string(client):
    kw = dict(messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    one = create(client, system="You are terse. Answer briefly.", **kw)
    blocks = create(client, system=[{"type": "text", "text": "You are terse. "},
                                    {"type": "text", "text": "Answer briefly."}], **kw)
    assert blocks.usage.input_tokens == one.usage.input_tokens and blocks.content[0].text == one.content[0].text


def test_max_tokens_ends_with_max_tokens(client):
    m = create(client, messages=[{"role": "user", "content": "Tell me a long story."}], max_tokens=3)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3


def test_stop_sequences_end_the_text_before_them(client):
    kw = dict(messages=[{"role": "user", "content": "Count from one to ten in words."}], max_tokens=40)
    text = create(client, **kw).content[0].text
    words = text.split()
    assert len(words) > 3, text
    stop = words[2]
    m = create(client, stop_sequences=["zzz-never", stop], **kw)
    assert stop not in m.content[0].text and text.startswith(m.content[0].text)
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)
    events = list(create(client, stop_sequences=["zzz-never", stop], stream=True, **kw))
    assert (events[-2].delta.stop_reason, events[-2].delta.stop_sequence) == ("stop_sequence", stop)


def test_sampling_fields_are_taken(client):
    kw = dict(messages=[{"role": "user", "content": "Write a word."}], max_tokens=8)
    a = create(client, temperature=1.0, extra_body={"top_p": 0.9, "top_k": 40}, **kw)
    assert a.content[0].text is not None and a.usage.output_tokens > 0


def test_multi_turn_content_blocks(client):
    m = create(client, messages=[
        {"role": "user", "content": [{"type": "text", "text": "My name is Ada."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello Ada."}]},
        {"role": "user", "content": "What is my name?"}])
    assert m.content[0].text and m.usage.input_tokens > 10


def test_stream_events_in_order(client):
    kw = dict(messages=[{"role": "user", "content": "Name three colours."}])
    plain = create(client, **kw)
    events = list(create(client, stream=True, **kw))
    types = [e.type for e in events]
    assert types[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(types[2:-3]) == {"content_block_delta"}
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == plain.content[0].text
    delta = events[-2]
    assert delta.delta.stop_reason == plain.stop_reason and delta.usage.output_tokens == plain.usage.output_tokens
    assert events[0].message.usage.input_tokens == plain.usage.input_tokens


def test_stream_helper_gives_the_same_message(client):
    kw = dict(model=MODEL_NAME, max_tokens=24, extra_body={"temperature": 0},
              messages=[{"role": "user", "content": "Say hi."}])
    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == client.messages.create(**kw).content[0].text


def test_count_tokens_is_the_prompt_the_model_sees(client):
    kw = dict(system="Be brief.", messages=ASK, tools=[WEATHER])
    counted = client.messages.count_tokens(model=MODEL_NAME, **kw)
    assert counted.input_tokens == create(client, max_tokens=2, **kw).usage.input_tokens


# --- tools ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0, 0.8])
def test_tool_choice_any_gives_a_valid_tool_use(client, temperature):
    m = create(client, messages=ASK, tools=[WEATHER, ADD], tool_choice={"type": "any"}, max_tokens=80,
               temperature=temperature)
    the_tool_use(m)
    assert all(b.type == "tool_use" for b in m.content)


@pytest.mark.parametrize("name", ["add", "get_weather"])
def test_tool_choice_tool_calls_that_tool(client, name):
    m = create(client, messages=[{"role": "user", "content": "Add 2 and 3, or check the weather in Oslo."}],
               tools=[WEATHER, ADD], tool_choice={"type": "tool", "name": name}, max_tokens=80)
    assert the_tool_use(m, (name,)).name == name


def test_tool_use_then_tool_result_then_answer(client):
    first = create(client, messages=ASK, tools=[WEATHER, ADD], tool_choice={"type": "any"}, max_tokens=80)
    use = the_tool_use(first)
    m = create(client, tools=[WEATHER, ADD], messages=ASK + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": json.dumps({"celsius": 18, "sky": "sunny"})}]}])
    assert m.content and m.usage.input_tokens > first.usage.input_tokens


def test_streamed_tool_use_is_input_json_deltas(client):
    kw = dict(messages=ASK, tools=[WEATHER, ADD], tool_choice={"type": "any"}, max_tokens=80)
    plain = the_tool_use(create(client, **kw))
    events = list(create(client, stream=True, **kw))
    assert [e.type for e in events] == ["message_start", "content_block_start", "content_block_delta",
                                        "content_block_stop", "message_delta", "message_stop"]
    assert events[1].content_block.type == "tool_use" and events[1].content_block.name == plain.name
    assert json.loads(events[2].delta.partial_json) == plain.input
    assert events[4].delta.stop_reason == "tool_use"
    with client.messages.stream(model=MODEL_NAME, extra_body={"temperature": 0}, **kw) as stream:
        assert the_tool_use(stream.get_final_message()).input == plain.input


def test_auto_and_none_answer_text(client):
    for choice in ({"type": "auto"}, {"type": "none"}):
        m = create(client, messages=ASK, tools=[WEATHER], tool_choice=choice, max_tokens=8)
        assert m.content[0].type == "text" and m.stop_reason in ("end_turn", "max_tokens")


# --- output_config.format -----------------------------------------------------------------------------


@pytest.mark.parametrize("i", [0, 2, 5, 9])
def test_output_format_json_schema_validates(client, i):
    prompt, schema = CASES[i]
    m = create(client, messages=[{"role": "user", "content": prompt}], max_tokens=160,
               output_config={"format": {"type": "json_schema", "schema": schema}})
    assert m.stop_reason == "end_turn"
    jsonschema.validate(json.loads(m.content[0].text), schema)


# --- errors --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("body, field", [
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "messages[0].content[0].tool_use_id"),
    ({"messages": [{"role": "user", "content": "x", "name": "ada"}]}, "messages[0].name"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                 "content": [{"type": "text", "text": "18", "colour": 1}]}]}]},
     "messages[0].content[0].content[0].colour"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {}, "colour": 1}}}, "output_config.format.colour"),
    ({"metadata": {"user_id": "u", "colour": 1}}, "metadata.colour"),
    ({"system": 5}, "system"),
    ({"tools": [{"input_schema": {"type": "object"}}]}, "tools[0].name"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"n": {"type": "integer",
                                                                                      "maximum": 3}}}}]},
     "tools[0].input_schema"),
    ({"tools": [WEATHER], "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "add"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"temperature": 1.5}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"stop_sequences": "END"}, "stop_sequences"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "integer", "minimum": 1}}}},
     "output_config.format.schema"),
    ({"frobnicate": True}, "frobnicate"),
])
def test_bad_input_is_400_in_anthropics_shape_naming_the_field(daemon, body, field):
    base = {"model": MODEL_NAME, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
    status, answer = post(daemon, {k: v for k, v in (base | body).items() if v is not None})
    assert status == 400, answer
    assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error", answer
    assert named(answer, field), answer


def test_missing_max_tokens_says_the_api_requires_it(daemon):
    status, answer = post(daemon, {"model": MODEL_NAME, "messages": ASK})
    assert status == 400 and "max_tokens" in answer["error"]["message"]


def test_unknown_model_is_404_in_anthropics_shape(client):
    with pytest.raises(anthropic.NotFoundError) as err:
        create(client, model="claude-9", messages=ASK)
    assert err.value.body["error"]["type"] == "not_found_error"


def test_client_leaving_mid_stream_frees_the_sequence(daemon):
    disconnect_mid_stream(daemon, "/v1/messages", {"model": MODEL_NAME, "max_tokens": 3000, "stream": True,
                                                   "messages": [{"role": "user", "content": "Tell me a long story."}]})


def test_the_sdks_x_api_key_is_checked(default_model, tmp_path):
    """With api_keys set, Anthropic's clients send the key as X-Api-Key; a wrong one is a 401 in Anthropic's shape."""
    d = start_daemon(tmp_path, {"model": str(default_model), "model_name": MODEL_NAME, "api_keys": [KEY]})
    try:
        good = anthropic.Anthropic(base_url=d.url, api_key=KEY, max_retries=0)
        assert create(good, messages=ASK, max_tokens=2).usage.output_tokens > 0
        status, answer = post(d, {"model": MODEL_NAME, "max_tokens": 2, "messages": ASK}, key="sk-wrong")
        assert status == 401 and answer["error"]["type"] == "authentication_error", answer
    finally:
        assert d.stop() == 0, d.log()


def test_daemon_still_serves_after_bad_input(client):
    assert create(client, messages=ASK, max_tokens=3).usage.output_tokens > 0
