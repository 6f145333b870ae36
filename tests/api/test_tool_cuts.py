"""Tool calls that max_tokens cuts short, against a real daemon through the official clients.

OpenAI answers a cut call as a call: `message.tool_calls` with the arguments as far as they got (not valid JSON),
`content` null and finish_reason "length"; streamed as tool_calls deltas. The Responses API gives a function_call
item with status "incomplete" in an incomplete response, the Messages API a tool_use block with stop_reason
"max_tokens". Never the call's JSON as text. Each cut is held against the same greedy call left whole: its
arguments are a prefix of the whole call's.
"""

from __future__ import annotations

import json

import pytest

from conftest import MODEL_NAME
from test_structured import TOOLS, WEATHER_ASK

# SmolLM2's forced call to get_weather is 28 tokens, `{ "name": "get_weather", "arguments": { "city": "Paris", ...`:
# 8 cuts inside the name ("get_"), 12 before the arguments, 20 inside them
CUTS = (8, 12, 20)
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# With an earlier call in the conversation SmolLM2 calls the tool by itself (tool_choice "auto"), 30 tokens:
# `<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", ...`; 13 cuts inside the name
AUTO_CUTS = (13, 17, 23)
EARLIER = {"id": "call_1", "type": "function",
           "function": {"name": "get_weather", "arguments": json.dumps({"city": "Oslo", "unit": "celsius"})}}
AUTO_ASK = [{"role": "user", "content": "What is the weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [EARLIER]},
            {"role": "user", "content": "What is the weather in Paris?"}]


def chat(client, **kw):
    return client.chat.completions.create(model=MODEL_NAME, tools=TOOLS, temperature=0, **kw)


def whole_call(client, **kw):
    """The greedy call left whole, and how many tokens it took."""
    r = chat(client, max_tokens=200, **kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls
    return call, r.usage.completion_tokens


def assert_cut_of(name: str, arguments: str, whole) -> None:
    assert name == whole.function.name
    assert whole.function.arguments.startswith(arguments), (arguments, whole.function.arguments)
    assert len(arguments) < len(whole.function.arguments)


def streamed(client, **kw) -> tuple[str, list, list[str]]:
    """A streamed answer's content, its tool_calls deltas and its finish reasons."""
    content, deltas, finishes = "", [], []
    for chunk in chat(client, stream=True, **kw):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            deltas += choice.delta.tool_calls or []
            finishes += [choice.finish_reason] if choice.finish_reason else []
    return content, deltas, finishes


def reassembled(deltas: list) -> tuple[str, str]:
    """(name, arguments) of one streamed call: index, id, type and name first, then the arguments in pieces."""
    first, *rest = deltas
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function", first
    assert all(d.index == 0 and d.id is None and (d.function.name or "") == "" for d in rest), rest
    return first.function.name, "".join(d.function.arguments or "" for d in deltas)


@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_cut_forced_call_is_a_tool_call_with_length(client, choice):
    whole, _ = whole_call(client, messages=WEATHER_ASK, tool_choice=choice)
    for cut in CUTS + ((1, 5) if choice == NAMED else ()):  # one function allowed: its name is known from the start
        r = chat(client, messages=WEATHER_ASK, tool_choice=choice, max_tokens=cut)
        c = r.choices[0]
        assert c.finish_reason == "length" and r.usage.completion_tokens == cut, (cut, c)
        assert c.message.content is None, (cut, c.message.content)
        (call,) = c.message.tool_calls
        assert call.id.startswith("call_") and call.type == "function"
        assert_cut_of(call.function.name, call.function.arguments, whole)


@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_cut_forced_call_streams_as_tool_call_deltas(client, choice):
    whole, _ = whole_call(client, messages=WEATHER_ASK, tool_choice=choice)
    content, deltas, finishes = streamed(client, messages=WEATHER_ASK, tool_choice=choice, max_tokens=200)
    assert (content, finishes) == ("", ["tool_calls"]) and reassembled(deltas) == (whole.function.name,
                                                                                  whole.function.arguments)
    for cut in CUTS:
        plain = chat(client, messages=WEATHER_ASK, tool_choice=choice, max_tokens=cut).choices[0].message
        content, deltas, finishes = streamed(client, messages=WEATHER_ASK, tool_choice=choice, max_tokens=cut)
        assert finishes == ["length"] and content == "", (cut, content, finishes)
        name, arguments = reassembled(deltas)
        assert_cut_of(name, arguments, whole)
        assert arguments == plain.tool_calls[0].function.arguments


def test_forced_call_cut_before_its_name_is_neither_call_nor_text(client):
    """required with two tools, cut at `{ "name": "`: which function it calls is not known yet."""
    r = chat(client, messages=WEATHER_ASK, tool_choice="required", max_tokens=5)
    c = r.choices[0]
    assert c.finish_reason == "length" and c.message.content is None and not c.message.tool_calls, c
    content, deltas, finishes = streamed(client, messages=WEATHER_ASK, tool_choice="required", max_tokens=5)
    assert (content, deltas, finishes) == ("", [], ["length"])


def test_call_whole_on_the_last_token_allowed_is_tool_calls(client):
    """The JSON closes on the last token max_tokens allows (the end-of-generation token is the one cut): whole."""
    whole, n = whole_call(client, messages=WEATHER_ASK, tool_choice=NAMED)
    c = chat(client, messages=WEATHER_ASK, tool_choice=NAMED, max_tokens=n - 1).choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls[0].function.arguments == whole.function.arguments


def test_cut_auto_call_is_a_tool_call_with_length(client):
    whole, _ = whole_call(client, messages=AUTO_ASK, tool_choice="auto")
    for cut in AUTO_CUTS:
        c = chat(client, messages=AUTO_ASK, tool_choice="auto", max_tokens=cut).choices[0]
        assert c.finish_reason == "length" and c.message.content is None, (cut, c)
        (call,) = c.message.tool_calls
        assert_cut_of(call.function.name, call.function.arguments, whole)
        content, deltas, finishes = streamed(client, messages=AUTO_ASK, tool_choice="auto", max_tokens=cut)
        assert finishes == ["length"] and content == "", (cut, content, finishes)
        assert reassembled(deltas) == (call.function.name, call.function.arguments)


def test_auto_cut_before_the_name_stays_text(client):
    """`<tool_call>\\n{"` with two tools: no call can be told, so auto gives the text as it was written."""
    c = chat(client, messages=AUTO_ASK, tool_choice="auto", max_tokens=7).choices[0]
    assert c.finish_reason == "length" and not c.message.tool_calls
    assert c.message.content == '<tool_call>\n{"'
    content, deltas, finishes = streamed(client, messages=AUTO_ASK, tool_choice="auto", max_tokens=7)
    assert (content, deltas, finishes) == ('<tool_call>\n{"', [], ["length"])


# --- the Responses API -----------------------------------------------------------------------------------

RESPONSES_TOOLS = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
                    "parameters": t["function"]["parameters"]} for t in TOOLS]


def chat_cut_arguments(client, cut: int) -> str:
    """The arguments the chat API gives get_weather's forced call cut at `cut` tokens (the same prompt)."""
    c = chat(client, messages=WEATHER_ASK, tool_choice=NAMED, max_tokens=cut).choices[0]
    return c.message.tool_calls[0].function.arguments


def test_responses_cut_call_is_an_incomplete_function_call(client):
    kw = dict(model=MODEL_NAME, input=WEATHER_ASK[0]["content"], tools=RESPONSES_TOOLS, temperature=0,
              tool_choice={"type": "function", "name": "get_weather"})
    whole = client.responses.create(max_output_tokens=200, **kw)
    (full,) = whole.output
    assert whole.status == "completed" and full.type == "function_call" and full.status == "completed"
    for cut in CUTS:
        r = client.responses.create(max_output_tokens=cut, **kw)
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens", r
        (item,) = r.output
        assert item.type == "function_call" and item.status == "incomplete" and item.call_id.startswith("call_")
        assert item.name == full.name and full.arguments.startswith(item.arguments) and not r.output_text
        assert item.arguments == chat_cut_arguments(client, cut)
        events = list(client.responses.create(max_output_tokens=cut, stream=True, **kw))
        deltas = ["response.function_call_arguments.delta"] if item.arguments else []  # none for no arguments yet
        assert [e.type for e in events] == [
            "response.created", "response.in_progress", "response.output_item.added", *deltas,
            "response.function_call_arguments.done", "response.output_item.done", "response.incomplete"]
        assert "".join(e.delta for e in events if e.type.endswith(".delta")) == events[-3].arguments == item.arguments
        assert events[-2].item.status == "incomplete" and events[-2].item.arguments == item.arguments
        assert events[-1].response.status == "incomplete" and events[-1].response.output[0].status == "incomplete"


# --- the Messages API ------------------------------------------------------------------------------------


@pytest.fixture
def anthropic_client(daemon):
    anthropic = pytest.importorskip("anthropic", reason="anthropic is in the test extras: pip install -e .[test]")
    return anthropic.Anthropic(base_url=daemon.url, api_key="unused", max_retries=0, timeout=120)


def test_messages_cut_tool_use_ends_with_max_tokens(anthropic_client, client):
    kw = dict(model=MODEL_NAME, messages=WEATHER_ASK, extra_body={"temperature": 0},
              tools=[{"name": t["function"]["name"], "description": t["function"]["description"],
                      "input_schema": t["function"]["parameters"]} for t in TOOLS],
              tool_choice={"type": "tool", "name": "get_weather"})
    whole = anthropic_client.messages.create(max_tokens=200, **kw)
    assert whole.stop_reason == "tool_use"
    (full,) = whole.content
    for cut in CUTS:
        m = anthropic_client.messages.create(max_tokens=cut, **kw)
        assert m.stop_reason == "max_tokens" and m.usage.output_tokens == cut, m
        (use,) = m.content
        assert use.type == "tool_use" and use.name == full.name and use.id.startswith("toolu_")
        # the input as the SDK reads a cut input_json: the members that arrived whole
        assert use.input.items() <= full.input.items() and (cut < 20 or use.input == {"city": "Paris"}), use.input
        events = list(anthropic_client.messages.create(max_tokens=cut, stream=True, **kw))
        arguments = chat_cut_arguments(client, cut)
        deltas = ["content_block_delta"] if arguments else []  # an empty partial_json is no JSON to the SDK
        assert [e.type for e in events] == ["message_start", "content_block_start", *deltas, "content_block_stop",
                                            "message_delta", "message_stop"]
        assert events[1].content_block.type == "tool_use" and events[1].content_block.name == full.name
        assert "".join(e.delta.partial_json for e in events if e.type == "content_block_delta") == arguments
        assert events[-2].delta.stop_reason == "max_tokens"
        with anthropic_client.messages.stream(max_tokens=cut, **kw) as stream:
            assert stream.get_final_message().content[0].input == use.input


# --- the parsers on cut shapes the model above does not write (no model needed) ---------------------------


def test_cut_calls_in_the_shapes_auto_reads():
    from syshaxd.api.core.tools import parse_output, parse_tools

    tools = parse_tools({"tools": TOOLS})
    # Llama 3.1's one JSON object with "parameters"; arguments written as a string of JSON, cut inside an escape
    for text, arguments in [('{"name": "add", "parameters": {"a": 4, "b": 5', '{"a": 4, "b": 5'),
                            ('{"name": "add", "arguments": "{\\"a\\": 4, \\"b\\', '{"a": 4, "b'),
                            ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
                             '<tool_call>\n{"name": "get_weather", "arguments": {"ci', '{"ci')]:
        content, calls = parse_output(text, tools, cut=True)
        assert content is None and (calls[-1].arguments, calls[-1].complete) == (arguments, False), text
        assert parse_output(text, tools) == (text, [])  # not cut (the model ended it so): the text stays text
    # only `</tool_call>` was cut: the call is whole
    content, (call,) = parse_output('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_', tools,
                                    cut=True)
    assert call.complete and call.arguments == '{"a": 1, "b": 2}'
    # a name cut where two functions fit it, or never begun outside a <tool_call> block: no call, the text stays
    one = parse_tools({"tools": [TOOLS[1], {"type": "function", "function": {"name": "add_more"}}]})
    for text, with_tools in [('{"name": "ad', one), ('{"argu', tools), ("<tool_call>\n{", tools)]:
        assert parse_output(text, with_tools, cut=True) == (text, []), text
    # one function: a <tool_call> block cut before its name calls it; one that holds no JSON object is text
    weather = parse_tools({"tools": TOOLS[:1]})
    (call,) = parse_output("<tool_call>\n{", weather, cut=True)[1]
    assert (call.name, call.arguments, call.complete) == ("get_weather", "", False)
    assert parse_output("<tool_call>\n```\n", weather, cut=True) == ("<tool_call>\n```\n", [])


def test_partial_object_keeps_what_arrived_whole():
    """A cut tool_use's input in the Messages API's JSON answer: what the anthropic SDK reads from the stream."""
    from syshaxd.api.core.tools import partial_object

    jiter = pytest.importorskip("jiter")  # the SDK's partial JSON reader
    for text in ['', '{', '{ "city', '{ "city": ', '{ "city": "Par', '{ "city": "Paris", "un', '{"a": 12', '{"a": 1.',
                 '{"a": tr', '{"a": [1, 2', '{"a": ["x", "y', '{"a": {"b": "x"', '{"a": "x\\"y", "b', '{"a": "x\\',
                 '{"a": {"b": [{"c": null}, {"d"', '{"a": 1}']:
        expected = jiter.from_json(text.encode(), partial_mode=True) if text else {}
        assert partial_object(text) == expected, text
