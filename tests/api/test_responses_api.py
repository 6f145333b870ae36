"""The Responses API (POST /v1/responses) against a real daemon, through the official openai client and the
OpenAI Agents SDK: text and item-list input, instructions, typed stream events, function tools and their
call / output items, text.format json_schema and json_object, and a 400 naming the field for bad input.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from conftest import MODEL_NAME, disconnect_mid_stream, http_json
from test_structured import CASES

WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}
ADD = {"type": "function", "name": "add", "description": "Add two integers",
       "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                      "required": ["a", "b"], "additionalProperties": False}}
SCHEMAS = {t["name"]: t["parameters"] for t in (WEATHER, ADD)}
ASK = "What is the weather in Paris?"


def create(client, **kw):
    return client.responses.create(model=MODEL_NAME, **({"temperature": 0, "max_output_tokens": 24} | kw))


def the_call(r, names=tuple(SCHEMAS)):
    """The response's one function_call item, its arguments valid against the function's schema."""
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1, r.output
    call = calls[0]
    assert call.name in names and call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    return call


# --- text --------------------------------------------------------------------------------------------


def test_text_input_answers_a_message(client):
    r = create(client, input="Say hello.")
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL_NAME
    assert r.status in ("completed", "incomplete")
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert r.output_text and r.output_text == message.content[0].text
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 24
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.model_extra["syshax"]["route"] == "cpu"


def test_max_output_tokens_makes_it_incomplete(client):
    r = create(client, input="Tell me a long story about a dragon.", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"


def test_instructions_and_item_lists_are_the_conversation(client):
    plain = create(client, input="What is my name?")
    r = create(client, instructions="You are a terse assistant.", input=[
        {"role": "developer", "content": "Answer in English."},
        {"role": "user", "content": [{"type": "input_text", "text": "My name is Ada."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello Ada."}]},
        {"role": "user", "content": "What is my name?"}])
    assert r.output_text and r.usage.input_tokens > plain.usage.input_tokens + 10
    assert r.instructions == "You are a terse assistant."


def test_store_is_accepted_and_answered_false(client):
    """Clients send store (true by default on OpenAI); nothing is stored here, and the answer says so."""
    r = create(client, input="Hi", store=True, metadata={"run": "7"}, user="u1", max_output_tokens=4)
    assert r.model_extra["store"] is False and r.metadata == {"run": "7"}


def test_stream_sends_the_typed_events_in_order(client):
    plain = create(client, input="Name three colours.")
    events = list(create(client, input="Name three colours.", stream=True))
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{plain.status}"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-4].text == events[-1].response.output_text == plain.output_text
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {events[-1].response.output[0].id}
    assert events[-1].response.usage.output_tokens == plain.usage.output_tokens


# --- function tools ------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0, 0.8])
def test_required_tool_choice_gives_a_valid_call(client, temperature):
    r = create(client, input=ASK, tools=[WEATHER, ADD], tool_choice="required", temperature=temperature,
               max_output_tokens=80)
    the_call(r)
    assert r.status == "completed" and not r.output_text


@pytest.mark.parametrize("name", ["add", "get_weather"])
def test_named_tool_choice_calls_that_function(client, name):
    r = create(client, input="Add 2 and 3, or check the weather in Oslo.", tools=[WEATHER, ADD],
               tool_choice={"type": "function", "name": name}, max_output_tokens=80)
    assert the_call(r, (name,)).name == name


def test_call_then_output_item_then_answer(client):
    """The round trip: the call item goes back as it came, with a function_call_output for it."""
    first = create(client, input=ASK, tools=[WEATHER, ADD], tool_choice="required", max_output_tokens=80)
    call = the_call(first)
    r = create(client, tools=[WEATHER, ADD], input=[
        {"role": "user", "content": ASK},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"celsius": 18})}])
    assert r.status in ("completed", "incomplete") and r.output
    assert r.usage.input_tokens > first.usage.input_tokens  # the call and its output are in the prompt


def test_streamed_call_events_carry_the_same_call(client):
    kw = dict(input=ASK, tools=[WEATHER, ADD], tool_choice="required", max_output_tokens=80)
    plain = the_call(create(client, **kw))
    events = list(create(client, stream=True, **kw))
    types = [e.type for e in events]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == events[4].arguments and events[4].name == plain.name
    assert json.loads(args) == json.loads(plain.arguments)
    assert the_call(events[-1].response).arguments == args


def test_auto_and_none_answer_text(client):
    for choice in ("none", "auto"):
        r = create(client, input=ASK, tools=[WEATHER], tool_choice=choice, max_output_tokens=8)
        assert r.output[0].type == "message" and r.output_text  # SmolLM2 answers in prose


# --- text.format ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("i", [0, 1, 2, 4, 9, 16])
def test_json_schema_format_validates(client, i):
    prompt, schema = CASES[i]
    kw = {"temperature": 0} if i % 2 == 0 else {"temperature": 0.9}
    r = create(client, input=prompt, max_output_tokens=160,
               text={"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}}, **kw)
    assert r.status == "completed", r.output_text
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


def test_json_schema_streamed_validates(client):
    prompt, schema = CASES[3]
    events = list(create(client, input=prompt, max_output_tokens=160, stream=True,
                         text={"format": {"type": "json_schema", "name": "answer", "schema": schema}}))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    jsonschema.validate(json.loads(text), schema)


def test_json_object_format_parses(client):
    r = create(client, input='Return {"ok": true}.', max_output_tokens=40, text={"format": {"type": "json_object"}})
    assert r.status == "completed" and isinstance(json.loads(r.output_text), dict)


def test_openai_parse_with_a_pydantic_model(client):
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=24)
        country: str = Field(max_length=24)

    r = client.responses.parse(model=MODEL_NAME, input="Name a city.", text_format=City, max_output_tokens=80,
                               temperature=0)
    assert isinstance(r.output_parsed, City)


# --- errors --------------------------------------------------------------------------------------------

TOOL_WITHOUT_NAME = {"type": "function", "parameters": {"type": "object", "properties": {}}}


@pytest.mark.parametrize("body, param", [
    ({"input": None}, "input"),
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": 5}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": 7}]}, "input[0].content"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0]"),  # with no assistant turn after it
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "function_call_output", "output": "18"}]}, "input[0].call_id"),
    ({"input": [{"role": "user", "content": "x", "colour": "red"}]}, "input[0].colour"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "x", "colour": 1}]}]},
     "input[0].content[0].colour"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "colour": 1}]},
     "input[0].colour"),
    ({"stream_options": {"include_usage": True}}, "stream_options.include_usage"),
    ({"instructions": 3}, "instructions"),
    ({"tools": [TOOL_WITHOUT_NAME]}, "tools[0].name"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [WEATHER | {"colour": 1}]}, "tools[0].colour"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "integer", "minimum": 1}}]},
     "tools[0].parameters"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "add"}}, "tool_choice.name"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "name": "a b", "schema": {}}}}, "text.format.name"),
    ({"text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "integer", "minimum": 1}}}},
     "text.format.schema"),
    ({"text": {"format": {"type": "text"}, "colour": 1}}, "text.colour"),
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"include": ["message.output_text.logprobs"]}, "include[0]"),
    ({"background": True}, "background"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"stream": "yes"}, "stream"),
    ({"frobnicate": 1}, "frobnicate"),
])
def test_bad_input_is_400_naming_the_field(daemon, body, param):
    status, answer = http_json(f"{daemon.base_url}/responses", {"model": MODEL_NAME, "input": "Hi"} | body)
    assert status == 400 and answer["error"]["param"] == param, answer
    assert param.split("[")[0].split(".")[0] in answer["error"]["message"], answer


def test_previous_response_id_says_what_to_send_instead(client):
    with pytest.raises(openai.BadRequestError) as err:
        create(client, input="Hi", previous_response_id="resp_123")
    assert "no store" in err.value.body["message"] and "input" in err.value.body["message"]


def test_unknown_model_is_404(daemon):
    status, answer = http_json(f"{daemon.base_url}/responses", {"model": "gpt-9", "input": "Hi"})
    assert status == 404 and answer["error"]["code"] == "model_not_found"


def test_client_leaving_mid_stream_frees_the_sequence(daemon):
    disconnect_mid_stream(daemon, "/v1/responses", {"model": MODEL_NAME, "input": "Tell me a very long story.",
                                                    "max_output_tokens": 3000, "stream": True})


def test_daemon_still_serves_after_bad_input(client):
    assert create(client, input="Still there?", max_output_tokens=3).usage.output_tokens > 0


# --- the OpenAI Agents SDK -----------------------------------------------------------------------------


@pytest.fixture
def agents_model(daemon):
    agents = pytest.importorskip("agents", reason="openai-agents is in the test extras: pip install -e .[test]")
    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=daemon.base_url, api_key="unused", max_retries=0, timeout=120)
    return agents.OpenAIResponsesModel(model=MODEL_NAME, openai_client=client)


def test_agent_calls_a_tool_and_answers(agents_model):
    from agents import Agent, ModelSettings, Runner, function_tool

    calls = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"It is sunny in {city}, 18 degrees."

    # the tool's answer is the agent's (a 135M model's own summary of it may run past any max_tokens, which
    # the SDK treats as a failure, as it would with OpenAI)
    agent = Agent(name="weather", instructions="Use the tool.", model=agents_model, tools=[get_weather],
                  tool_use_behavior="stop_on_first_tool",
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=60))
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=2)
    assert len(calls) == 1 and isinstance(calls[0], str) and calls[0]
    assert result.final_output == f"It is sunny in {calls[0]}, 18 degrees."


def test_agent_streams_a_structured_output(agents_model):
    import asyncio

    from agents import Agent, ModelSettings, Runner
    from pydantic import BaseModel, Field

    class Colour(BaseModel):
        name: str = Field(max_length=16)
        warm: bool

    agent = Agent(name="colours", instructions="Answer with one colour.", model=agents_model, output_type=Colour,
                  model_settings=ModelSettings(temperature=0, max_tokens=60))

    async def run():
        result = Runner.run_streamed(agent, "Pick a colour.")
        kinds = {event.type async for event in result.stream_events()}
        return result, kinds

    result, kinds = asyncio.run(run())
    assert "raw_response_event" in kinds
    assert isinstance(result.final_output, Colour)
