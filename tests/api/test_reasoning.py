"""Reasoning models against real daemons: a model's <think> block comes back apart from its answer, as vLLM's reasoning
parsers and llama-server's reasoning_format give it -- chat's `reasoning_content` (and `reasoning`), the Responses
API's reasoning item, the Messages API's thinking block -- streamed and not, through the official openai and
anthropic clients.

The model is the default SmolLM2-135M with a reasoning model's real chat template written into a copy of its GGUF by
gguf-py's gguf_new_metadata (as a user fixes a GGUF's template): the templates ship in llama.cpp's source
(mk/llama-source.sh). QwQ's opens `<think>\\n` in the prompt itself, so the output starts as thinking; Qwen3's leaves
the model to open it (and takes enable_thinking). The daemon's own template (ChatML) is not a thinking template:
its answers are unchanged. Greedy text of a trained model is deterministic; where a test needs a thinking block the
model does not write by itself, llama-server's `grammar` (which holds the whole output, as there) writes it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import jsonschema
import openai
import pytest

from conftest import MODEL_DIR, MODEL_NAME, http_json, start_daemon
from families import llama_source

from syshaxd.api.core.reasoning import ThinkSplit, after_thinking, opens_thinking, split_whole

anthropic = pytest.importorskip("anthropic", reason="anthropic is in the test extras: pip install -e .[test]")

SERVE = {"model_name": MODEL_NAME, "n_ctx": 1024, "cpu_max_batch_size": 4, "prefix_cache_mb": 64}
TWO = [{"role": "user", "content": "What is 2+2?"}]
# SmolLM2 under QwQ's template repeats this and stops: its own </think> ends the thinking
REPEAT = [{"role": "user", "content": "Repeat after me: hello </think> world"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}


def _with_template(out_dir, template: str):
    """A copy of the default GGUF carrying llama.cpp's copy of a model's chat template, made as a user makes one."""
    target = out_dir / f"smollm2-{template.removesuffix('.jinja')}.gguf"
    source = llama_source() / "models" / "templates" / template
    done = subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_new_metadata", str(MODEL_DIR /
                           "SmolLM2-135M-Instruct.q4_0.gguf"), str(target), "--chat-template-file", str(source),
                           "--force"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return target


def _serve(tmp_path_factory, template: str):
    out = tmp_path_factory.mktemp(template.split("-")[1])
    return start_daemon(out, SERVE | {"model": str(_with_template(out, template)), "model_dir": str(out)})


@pytest.fixture(scope="module")
def qwq(default_model, tmp_path_factory):
    d = _serve(tmp_path_factory, "Qwen-QwQ-32B.jinja")
    yield d
    assert d.stop() == 0, d.log()


@pytest.fixture(scope="module")
def qwen3(default_model, tmp_path_factory):
    d = _serve(tmp_path_factory, "Qwen-Qwen3-0.6B.jinja")
    yield d
    assert d.stop() == 0, d.log()


def client_of(daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.base_url, api_key="unused", max_retries=0, timeout=120)


def chat(daemon, messages, **kw):
    return client_of(daemon).chat.completions.create(model=MODEL_NAME, messages=messages,
                                                    **({"temperature": 0, "max_tokens": 48} | kw))


def streamed(daemon, messages, **kw) -> tuple[list[tuple[str, str]], dict]:
    """The stream's deltas in order, as (field, text) for reasoning_content and content, and the last chunk's
    finish_reason and usage."""
    chunks = list(chat(daemon, messages, stream=True, stream_options={"include_usage": True}, **kw))
    deltas, end = [], {}
    for chunk in chunks:
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            if extra.get("reasoning_content"):
                assert extra["reasoning"] == extra["reasoning_content"]  # vLLM's name beside llama-server's
                deltas.append(("reasoning_content", extra["reasoning_content"]))
            if choice.delta.content:
                deltas.append(("content", choice.delta.content))
            if choice.finish_reason:
                end["finish_reason"] = choice.finish_reason
        if chunk.usage is not None:
            end["usage"] = chunk.usage
    return deltas, end


def joined(deltas, field: str) -> str | None:
    return "".join(text for f, text in deltas if f == field) or None


def thinking_of(message) -> str | None:
    extra = message.model_extra or {}
    assert extra.get("reasoning") == extra.get("reasoning_content")
    return extra.get("reasoning_content")


def tokenized_text(daemon, body: dict) -> str:
    status, answer = http_json(f"{daemon.url}/tokenize", {"with_pieces": True} | body)
    assert status == 200, answer
    return "".join(t["piece"] for t in answer["tokens"])


# --- the reader, on its own ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, opened, expected", [
    ("<think>\nhmm\n</think>\n\nHello", False, ("hmm", "Hello", True)),
    ("  <think>a</think>b", False, ("a", "b", True)),
    ("Hello <think>x</think>", False, ("", "Hello <think>x</think>", False)),  # not at the start: text
    ("\n\nHello", False, ("", "\n\nHello", False)),  # no thinking: the output as it came
    ("\nThe answer is 4.", True, ("The answer is 4.", "", True)),  # cut or ended inside the thinking
    ("so far </thi", True, ("so far </thi", "", True)),  # a closing tag cut short stays in the thinking
    ("think\n\n </think>\n\n answer \n", True, ("think", "answer \n", True)),
    ("<thi", False, ("", "<thi", False)),
    ("<think>\n\n</think>\n\nHi", False, ("", "Hi", True)),
])
def test_an_output_is_read_apart_the_same_in_any_pieces(text, opened, expected):
    assert split_whole(text, opened) == expected
    for size in (1, 2, 3, 5):
        split = ThinkSplit(opened)
        parts = [split.feed(text[i:i + size]) for i in range(0, len(text), size)] + [split.finish()]
        assert ("".join(t for t, _ in parts), "".join(a for _, a in parts), split.thought) == expected


def test_only_a_prompt_that_ends_in_an_open_think_starts_the_output_as_thinking():
    assert opens_thinking("<|im_start|>assistant\n<think>\n")
    assert opens_thinking("<｜Assistant｜><think>\n")
    assert not opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # Qwen3 with thinking off
    assert not opens_thinking("mention <think> here<|im_end|>\n<|im_start|>assistant\n")  # a user's text


def test_a_grammar_after_thinking_holds_the_answer_not_the_thinking(default_model):
    """The grammar a schema becomes, moved after the thinking, checked token by token by llama.cpp's own grammar
    sampler: the thinking is free until the first </think>, the answer must match."""
    import ctypes
    import math

    import llama_cpp
    from syshax_llamacpp.sampling import accept, make_sampler

    from syshaxd.api.core.structured import schema_to_grammar
    from syshaxd.sdk.gguf.vocab import Vocab
    from syshaxd.sdk.types import SamplingParams

    vocab = Vocab(default_model)
    inner = schema_to_grammar({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, "x")

    def takes(grammar: str, text: str) -> bool:
        chain = make_sampler(SamplingParams(temperature=0), vocab.n_vocab, grammar, vocab.vocab)
        try:
            if not all(accept(chain, t, True) for t in vocab.tokenize(text, add_special=False)):
                return False
            cell = llama_cpp.llama_token_data(llama_cpp.llama_vocab_eos(vocab.vocab), 0.0, 0.0)  # may it end here?
            cur = llama_cpp.llama_token_data_array(ctypes.pointer(cell), 1, -1, False)
            llama_cpp.llama_sampler_apply(llama_cpp.llama_sampler_chain_get(chain, 0), ctypes.byref(cur))
            return not math.isinf(cell.logit)
        finally:
            llama_cpp.llama_sampler_free(chain)

    opened, closed = after_thinking(inner, True), after_thinking(inner, False)
    assert takes(opened, 'a <b> is </thi nothing</think>\n\n{"a": 1}')
    assert not takes(opened, '{"a": 1}')  # JSON inside the open thinking is no answer
    assert not takes(opened, 'x</think>{"a": "one"}')
    assert takes(closed, '{"a": 1}') and takes(closed, '<think>\nhm\n</think>\n\n{"a": 1}')
    assert not takes(closed, 'hm</think>{"a": 1}')
    named_root = 'root ::= "[" root-item "]"\nroot-item ::= "x" # root\n'  # only the rule named root is renamed
    assert takes(after_thinking(named_root, False), "[x]")


def test_vllms_grammar_library_reads_the_grammar_after_thinking_alike():
    """gpu mode's vLLM enforces the same GBNF with xgrammar."""
    accepts = pytest.importorskip("xgrammar.testing", reason="vLLM's grammar library")._is_grammar_accept_string
    from syshaxd.api.core.structured import schema_to_grammar

    inner = schema_to_grammar({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, "x")
    opened, closed = after_thinking(inner, True), after_thinking(inner, False)
    assert accepts(opened, 'a <b> is </thi nothing</think>\n\n{"a": 1}') and not accepts(opened, '{"a": 1}')
    assert accepts(closed, '{"a": 1}') and accepts(closed, '<think>\nhm\n</think>\n\n{"a": 1}')
    assert not accepts(closed, 'hm</think>{"a": 1}')


# --- chat completions ----------------------------------------------------------------------------------------------


def test_a_model_without_a_thinking_template_answers_as_before(daemon):
    r = chat(daemon, TWO)
    assert "reasoning_content" not in (r.choices[0].message.model_extra or {})
    assert r.usage.completion_tokens_details is None
    deltas, end = streamed(daemon, TWO)
    assert {f for f, _ in deltas} == {"content"} and joined(deltas, "content") == r.choices[0].message.content
    assert end["usage"].completion_tokens_details is None


def test_thinking_opened_by_the_template_comes_back_as_reasoning_content(qwq):
    raw = chat(qwq, TWO, extra_body={"reasoning_format": "none"}).choices[0].message
    assert "reasoning_content" not in (raw.model_extra or {})
    r = chat(qwq, TWO)
    message = r.choices[0].message
    # the whole answer is thinking: the model ended inside the block the prompt opened
    assert thinking_of(message) == raw.content.strip() and thinking_of(message)
    assert message.content is None and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens_details.reasoning_tokens == r.usage.completion_tokens
    deltas, end = streamed(qwq, TWO)
    assert {f for f, _ in deltas} == {"reasoning_content"} and joined(deltas, "reasoning_content") == \
        thinking_of(message)
    assert end["usage"].completion_tokens_details.reasoning_tokens == r.usage.completion_tokens
    both = chat(qwq, TWO, n=2).choices  # each choice read apart on its own
    assert [(thinking_of(c.message), c.message.content) for c in both] == [(thinking_of(message), None)] * 2


def test_the_models_own_end_of_thinking_splits_it_from_the_answer(qwq):
    raw = chat(qwq, REPEAT, extra_body={"reasoning_format": "none"}).choices[0].message.content
    assert "</think>" in raw
    thought, answer = raw.split("</think>", 1)
    r = chat(qwq, REPEAT)
    message = r.choices[0].message
    assert thinking_of(message) == thought.strip() and message.content == answer.lstrip()
    assert 0 < r.usage.completion_tokens_details.reasoning_tokens < r.usage.completion_tokens
    deltas, _ = streamed(qwq, REPEAT)
    fields = [f for f, _ in deltas]
    assert fields == sorted(fields, key=lambda f: f != "reasoning_content")  # all the thinking first
    assert (joined(deltas, "reasoning_content"), joined(deltas, "content")) == (thinking_of(message), message.content)


def test_max_tokens_inside_the_thinking_leaves_no_content(qwq):
    r = chat(qwq, TWO, max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content is None
    assert thinking_of(r.choices[0].message)
    deltas, end = streamed(qwq, TWO, max_tokens=3)
    assert end["finish_reason"] == "length" and joined(deltas, "content") is None
    assert joined(deltas, "reasoning_content") == thinking_of(r.choices[0].message)


def test_a_block_the_model_opens_itself_is_read_apart(qwen3):
    wrote = 'root ::= "<think>\\nI should greet.\\n</think>\\n\\nHello!"'  # llama-server's grammar: the whole output
    r = chat(qwen3, TWO, extra_body={"grammar": wrote})
    message = r.choices[0].message
    assert (thinking_of(message), message.content) == ("I should greet.", "Hello!")
    deltas, _ = streamed(qwen3, TWO, extra_body={"grammar": wrote})
    assert deltas[0][0] == "reasoning_content" and deltas[-1][0] == "content"
    assert (joined(deltas, "reasoning_content"), joined(deltas, "content")) == ("I should greet.", "Hello!")
    assert chat(qwen3, TWO, extra_body={"grammar": wrote, "reasoning_format": "none"}).choices[0].message.content \
        == "<think>\nI should greet.\n</think>\n\nHello!"
    plain = chat(qwen3, TWO).choices[0].message  # no block written: all content, the thinking null
    assert plain.content and "reasoning_content" in plain.model_extra and thinking_of(plain) is None


def test_enable_thinking_and_reasoning_effort_none_render_the_template_without_thinking(qwq, qwen3):
    assert tokenized_text(qwq, {"messages": TWO}).endswith("<think>\n")
    off = tokenized_text(qwq, {"messages": TWO, "chat_template_kwargs": {"enable_thinking": False}})
    assert off.endswith("<think>\n</think>")
    assert tokenized_text(qwen3, {"messages": TWO}).endswith("<|im_start|>assistant\n")
    assert tokenized_text(qwen3, {"messages": TWO, "chat_template_kwargs": {"enable_thinking": False}}) \
        .endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    on = chat(qwq, TWO)
    for ask in ({"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}):
        r = chat(qwq, TWO, extra_body=ask)
        assert r.usage.prompt_tokens > on.usage.prompt_tokens  # the template closed the block in the prompt
        assert thinking_of(r.choices[0].message) is None and r.choices[0].message.content.strip()


def test_an_answer_sent_back_with_its_thinking_is_rendered_by_a_template_that_reads_it(qwen3):
    """The openai SDK's message, dumped into the next request as clients do: both names of the thinking are taken,
    and Qwen3's template writes it into the turns after the last user message (a tool call's)."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    turns = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": "I need the tool.",
              "reasoning": "I need the tool."},
             {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    assert "<think>\nI need the tool.\n</think>" in tokenized_text(qwen3, {"messages": turns})
    r = chat(qwen3, turns, tools=[WEATHER], max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    again = chat(qwen3, TWO + [r.choices[0].message.model_dump(exclude_none=True), TWO[0]], max_tokens=4)
    assert again.choices[0].finish_reason in ("stop", "length")


def test_tool_calls_are_read_from_the_answer_after_the_thinking(qwen3):
    thinking = "I could write <tool_call> here, but not yet."
    call = '<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": \\"Paris\\"}}\\n</tool_call>'
    wrote = f'root ::= "<think>\\n{thinking}\\n</think>\\n\\n{call}"'
    r = chat(qwen3, TWO, tools=[WEATHER], max_tokens=128, extra_body={"grammar": wrote})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and thinking_of(choice.message) == thinking
    assert choice.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
        [("get_weather", {"city": "Paris"})]
    chunks = list(chat(qwen3, TWO, tools=[WEATHER], max_tokens=128, stream=True, extra_body={"grammar": wrote}))
    thought = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks
                      if c.choices)
    calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or ()]
    assert thought == thinking and calls[0].function.name == "get_weather"
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)


def test_a_forced_call_and_a_schema_still_hold_on_a_thinking_template(qwen3):
    """Qwen3's template leaves the model to open a block; SmolLM2's vocabulary spells `<think>` out, so the grammar
    holds the output from its start (a model with a <think> token may open a block first: the grammar test above)."""
    r = chat(qwen3, [{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER], tool_choice="required")
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    schema = {"type": "object", "properties": {"sum": {"type": "integer"}}, "required": ["sum"],
              "additionalProperties": False}
    r = chat(qwen3, TWO, response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


@pytest.mark.parametrize("extra, param", [
    ({"reasoning_format": "deepseek-legacy"}, "reasoning_format"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
    ({"chat_template_kwargs": {"enable_thinking": "no"}}, "chat_template_kwargs.enable_thinking"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"reasoning_effort": "max"}, "reasoning_effort"),
    ({"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}}, "reasoning_effort"),
    ({"messages": [{"role": "user", "content": "x", "reasoning_content": "y"}]}, "messages[0].reasoning_content"),
    ({"messages": [{"role": "assistant", "content": "x", "reasoning_content": 3}]}, "messages[0].reasoning_content"),
    ({"messages": [{"role": "assistant", "content": "x", "reasoning_content": "a", "reasoning": "b"}]},
     "messages[0].reasoning"),
])
def test_bad_reasoning_fields_are_a_400_naming_them(qwq, extra, param):
    status, answer = http_json(f"{qwq.base_url}/chat/completions",
                               {"model": MODEL_NAME, "max_tokens": 2, "messages": TWO} | extra)
    assert status == 400 and answer["error"]["param"] == param, answer


# --- the Responses API ---------------------------------------------------------------------------------------------


def test_responses_give_the_thinking_as_a_reasoning_item_before_the_message(qwq):
    expected = chat(qwq, REPEAT).choices[0].message
    client = client_of(qwq)
    r = client.responses.create(model=MODEL_NAME, input=REPEAT[0]["content"], temperature=0, max_output_tokens=48)
    assert [item.type for item in r.output] == ["reasoning", "message"] and r.status == "completed"
    reasoning, message = r.output
    assert reasoning.content[0].type == "reasoning_text" and reasoning.summary == []
    assert reasoning.content[0].text == thinking_of(expected) and r.output_text == expected.content
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    events = list(client.responses.create(model=MODEL_NAME, input=REPEAT[0]["content"], temperature=0,
                                          max_output_tokens=48, stream=True))
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thinking_of(expected)
    final = events[-1].response
    assert final.output[0].id == reasoning_id(events) and final.output[1].content[0].text == expected.content
    with client.responses.stream(model=MODEL_NAME, input=REPEAT[0]["content"], temperature=0,
                                 max_output_tokens=48) as stream:  # the SDK's own accumulation of the events
        assert stream.get_final_response().output_text == expected.content


def reasoning_id(events) -> str:
    return next(e.item.id for e in events if e.type == "response.output_item.added" and e.item.type == "reasoning")


def test_responses_cut_inside_the_thinking_are_an_incomplete_reasoning_item(qwq):
    r = client_of(qwq).responses.create(model=MODEL_NAME, input="What is 2+2?", temperature=0, max_output_tokens=3)
    assert r.status == "incomplete" and [(i.type, i.status) for i in r.output] == [("reasoning", "incomplete")]


def test_responses_take_reasoning_effort_and_reasoning_items_sent_back(qwq, daemon):
    client = client_of(qwq)
    off = client.responses.create(model=MODEL_NAME, input="What is 2+2?", temperature=0, max_output_tokens=24,
                                  reasoning={"effort": "none"})
    assert [i.type for i in off.output] == ["message"] and off.reasoning.effort == "none"
    first = client.responses.create(model=MODEL_NAME, input=REPEAT[0]["content"], temperature=0, max_output_tokens=48)
    turns = [{"role": "user", "content": REPEAT[0]["content"]}, *[i.model_dump(exclude_none=True)
                                                                   for i in first.output],
             {"role": "user", "content": "Again."}]
    again = client.responses.create(model=MODEL_NAME, input=turns, temperature=0, max_output_tokens=4)
    assert again.status in ("completed", "incomplete")
    status, answer = http_json(f"{daemon.base_url}/responses", {"model": MODEL_NAME, "input": "Hi",
                                                                "reasoning": {"effort": "high"}})
    assert status == 400 and answer["error"]["param"] == "reasoning.effort", answer  # SmolLM2's template: no thinking
    status, answer = http_json(f"{qwq.base_url}/responses", {"model": MODEL_NAME, "input": [
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "x"}]},
        {"role": "user", "content": "Hi"}]})
    assert status == 400 and answer["error"]["param"] == "input[0]", answer


# --- the Messages API ----------------------------------------------------------------------------------------------


def anthropic_of(daemon):
    return anthropic.Anthropic(base_url=daemon.url, api_key="unused", max_retries=0, timeout=120)


def message_of(daemon, messages, **kw):
    return anthropic_of(daemon).messages.create(**({"model": MODEL_NAME, "max_tokens": 48, "messages": messages,
                                                   "extra_body": {"temperature": 0}} | kw))


def test_messages_give_the_thinking_as_a_thinking_block_before_the_text(qwq):
    expected = chat(qwq, REPEAT).choices[0].message
    m = message_of(qwq, REPEAT)
    assert [b.type for b in m.content] == ["thinking", "text"] and m.stop_reason == "end_turn"
    assert (m.content[0].thinking, m.content[0].signature, m.content[1].text) == \
        (thinking_of(expected), "", expected.content)
    with anthropic_of(qwq).messages.stream(model=MODEL_NAME, max_tokens=48, messages=REPEAT,
                                           extra_body={"temperature": 0}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in m.content]
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert deltas == sorted(deltas, key=lambda t: t != "thinking_delta") and "thinking_delta" in deltas
    cut = message_of(qwq, TWO, max_tokens=3)
    assert [b.type for b in cut.content] == ["thinking"] and cut.stop_reason == "max_tokens"


def test_messages_thinking_settings(qwq, daemon):
    off = message_of(qwq, TWO, thinking={"type": "disabled"})
    assert [b.type for b in off.content] == ["text"]
    on = message_of(qwq, REPEAT, thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in on.content] == ["thinking", "text"]
    hidden = message_of(qwq, REPEAT, thinking={"type": "adaptive", "display": "omitted"})
    assert [(b.type, getattr(b, "thinking", None)) for b in hidden.content][0] == ("thinking", "")
    with pytest.raises(anthropic.BadRequestError, match="'thinking'"):  # SmolLM2's own template has no thinking
        message_of(daemon, TWO, thinking={"type": "enabled", "budget_tokens": 1024})
    with pytest.raises(anthropic.BadRequestError, match="thinking.type"):
        message_of(qwq, TWO, thinking={"type": "sometimes"})


def test_thinking_blocks_sent_back_reach_a_template_that_renders_them(qwen3):
    turns = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": [{"type": "thinking", "thinking": "I need the tool.", "signature": ""},
                                               {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                "input": {"city": "Paris"}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}]
    tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
    client = anthropic_of(qwen3)
    counted = client.messages.count_tokens(model=MODEL_NAME, messages=turns, tools=[tool]).input_tokens
    bare = [turns[0], {"role": "assistant", "content": turns[1]["content"][1:]}, turns[2]]
    assert counted > client.messages.count_tokens(model=MODEL_NAME, messages=bare, tools=[tool]).input_tokens
    assert message_of(qwen3, turns, tools=[tool], max_tokens=4).stop_reason in ("end_turn", "max_tokens", "tool_use")
