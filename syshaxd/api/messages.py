"""POST /v1/messages (and /v1/messages/count_tokens): Anthropic's Messages API over the chat pipeline.

The body becomes a chat body (system -> a system message, tool_use / tool_result blocks ->
assistant tool calls and tool messages, tools with input_schema, tool_choice auto / any / tool /
none, output_config.format -> response_format, thinking -> enable_thinking) that parse_chat checks;
the output is read as thinking, text and tool calls (api/core/outputs.py) and written as Anthropic's stream
events: a reasoning model's thinking is a `thinking` block before the text. A JSON answer is folded from
the same events. Errors leave in Anthropic's shape (app.py's middleware), their
message naming the field.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from aiohttp import web

from syshaxd.api.core import fields, sse
from syshaxd.api.core.chat_translation import (TOOL_RULES, Renames, Translated, chat_tool, chat_tools, expect, required,
                                               text_parts)
from syshaxd.api.core.app_keys import MODEL_NAME, STATE, VOCAB
from syshaxd.api.core.errors import APIError, invalid, one_of
from syshaxd.api.core.fields import check_fields
from syshaxd.api.core.generation import Generation, read_body, serve
from syshaxd.api.core.outputs import Finish, Step
from syshaxd.api.core.tools import partial_object
from syshaxd.api.core.validate import parse_chat

routes = web.RouteTableDef()

ROLES = ("user", "assistant")
THINKING_TYPES = ("enabled", "adaptive", "disabled")
DISPLAYS = ("summarized", "omitted")  # summarized: the thinking as the model wrote it (no summary is made)
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # "tool" names one: chat's named function

# chat's names for what this endpoint calls otherwise (error params and messages)
_RULES = [
    (r"^stop$|(?<=')stop(?=')", "stop_sequences"),
    (r"response_format\.json_schema\.schema", "output_config.format.schema"),
    (r"response_format(\.json_schema)?", "output_config.format"),
    (r"tools\[(\d+)\]\.function\.parameters", r"tools[\1].input_schema"),
    *TOOL_RULES,
    (r"parallel_tool_calls", "tool_choice.disable_parallel_tool_use"),
]


def _texts(content: Any, where: str) -> str:
    """A string, or text blocks joined (system, and a tool_result's content)."""
    return text_parts(content, where, ("text",))


def _turn(i: int, m: Any) -> list[dict]:
    """One Anthropic message as chat messages: tool results become tool messages, tool uses an assistant's calls, and
    an assistant's thinking blocks its `reasoning_content` (which some templates render)."""
    where = f"messages[{i}]"
    expect(m, dict, where, "an object")
    role = m.get("role")
    if role not in ROLES:
        raise invalid(f"Invalid '{where}.role': {role!r}; it must be 'user' or 'assistant' (the system prompt goes "
                      "in the top-level 'system').", param=f"{where}.role")
    content = required(m, "content", where)
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    expect(content, list, f"{where}.content", "a string or an array of content blocks")
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict] = []
    results: list[dict] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        expect(block, dict, at, "an object")
        kind = block.get("type")
        if kind == "text":
            texts.append(expect(required(block, "text", at), str, f"{at}.text", "a string"))
        elif kind == "thinking" and role == "assistant":
            thoughts.append(expect(required(block, "thinking", at), str, f"{at}.thinking", "a string"))
        elif kind == "redacted_thinking" and role == "assistant":
            raise invalid(f"Invalid '{at}.type': 'redacted_thinking' is another server's encrypted thinking, which "
                          "cannot be read here; leave the block out.", param=f"{at}.type")
        elif kind == "tool_use" and role == "assistant":
            args = expect(required(block, "input", at), dict, f"{at}.input", "an object")
            calls.append({"id": expect(required(block, "id", at), str, f"{at}.id", "a string"), "type": "function",
                          "function": {"name": expect(required(block, "name", at), str, f"{at}.name", "a string"),
                                       "arguments": json.dumps(args, ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user":
            text = _texts(block.get("content", ""), f"{at}.content")
            if block.get("is_error"):
                text = f"Error: {text}"
            results.append({"role": "tool", "content": text,
                            "tool_call_id": expect(required(block, "tool_use_id", at), str, f"{at}.tool_use_id",
                                                   "a string")})
        else:
            allowed = "text, thinking and tool_use" if role == "assistant" else "text and tool_result"
            raise invalid(f"Invalid '{at}.type': {kind!r}; a {role} message takes {allowed} blocks here (images, "
                          "documents are not supported).", param=f"{at}.type")
    if role == "assistant":
        message = {"role": "assistant", "content": "".join(texts)}
        if thoughts:
            message["reasoning_content"] = "".join(thoughts)
        return [message | {"tool_calls": calls}] if calls else [message]
    return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])


def _tool(at: str, tool: dict) -> dict:
    if tool.get("type") not in (None, "custom"):
        raise invalid(f"Invalid '{at}.type': {tool.get('type')!r}; only client tools (name, description, "
                      "input_schema) are supported: this server runs no server tools.", param=f"{at}.type")
    return chat_tool(tool.get("name"), tool.get("description"), required(tool, "input_schema", at))


def _tool_choice(body: dict, chat: dict) -> None:
    choice = body.get("tool_choice")
    if choice is None:
        return
    expect(choice, dict, "tool_choice", "an object")
    kind = choice.get("type")
    if kind == "tool":
        chat["tool_choice"] = {"type": "function", "function": {"name": required(choice, "name", "tool_choice")}}
    elif isinstance(kind, str) and kind in TOOL_CHOICES:
        chat["tool_choice"] = TOOL_CHOICES[kind]
    else:
        raise invalid(f"Invalid 'tool_choice.type': {kind!r}; it must be one of auto, any, tool, none.",
                      param="tool_choice.type")
    no_parallel = choice.get("disable_parallel_tool_use")
    if no_parallel is not None:
        chat["parallel_tool_calls"] = not expect(no_parallel, bool, "tool_choice.disable_parallel_tool_use",
                                                 "a boolean")


def _thinking(body: dict, chat: dict) -> str:
    """thinking: "disabled" renders the template with enable_thinking false; "enabled" (its budget_tokens is not held
    apart: max_tokens bounds the thinking and the answer together) and "adaptive" ask for the model's thinking, which
    is its own default. The field that asks the model to think ("" when none does)."""
    thinking = body.get("thinking")
    if thinking is None:
        return ""
    expect(thinking, dict, "thinking", "an object")
    kind = thinking.get("type")
    one_of(kind, THINKING_TYPES, "thinking.type")
    budget = thinking.get("budget_tokens")
    if kind == "enabled":
        budget = expect(required(thinking, "budget_tokens", "thinking"), int, "thinking.budget_tokens", "an integer")
    if budget is not None and (kind != "enabled" or budget < 1):
        raise invalid("Invalid 'thinking.budget_tokens': it goes with type 'enabled', as a positive integer.",
                      param="thinking.budget_tokens")
    display = thinking.get("display")
    if display is not None and (kind == "disabled" or display not in DISPLAYS):
        raise invalid(f"Invalid 'thinking.display': {display!r}; with thinking enabled or adaptive it is one of "
                      f"{', '.join(map(repr, DISPLAYS))}.", param="thinking.display")
    if kind == "disabled":
        chat["chat_template_kwargs"] = {"enable_thinking": False}
        return ""
    return "thinking"


def _options(body: dict, chat: dict) -> None:
    """output_config and metadata: what of them this server serves."""
    config = body.get("output_config")
    if config is not None:
        expect(config, dict, "output_config", "an object")
        fmt = config.get("format")
        if fmt is not None:
            expect(fmt, dict, "output_config.format", "an object")
            if fmt.get("type") != "json_schema":
                raise invalid(f"Invalid 'output_config.format.type': {fmt.get('type')!r}; it must be 'json_schema'.",
                              param="output_config.format.type")
            chat["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": required(fmt, "schema", "output_config.format")}}
    if body.get("metadata") is not None:
        expect(body["metadata"], dict, "metadata", "an object")


def to_chat(body: dict, counting: bool = False) -> tuple[dict, Renames]:
    """The chat body that means what the Messages body means (counting: count_tokens's prompt-only body), and how
    to name chat's errors back."""
    check_fields(body, fields.MESSAGES_COUNT if counting else fields.MESSAGES)
    if not counting:
        max_tokens = body.get("max_tokens")
        if max_tokens is None:  # Anthropic requires it; there is no default to fall back on
            raise invalid("Missing required parameter: 'max_tokens' (the Messages API requires it).",
                          param="max_tokens", code="missing_required_parameter")
        temperature = body.get("temperature")
        if temperature is not None and not isinstance(temperature, bool) and isinstance(temperature, (int, float)) \
                and not 0.0 <= temperature <= 1.0:  # Anthropic's range, narrower than chat's
            raise invalid(f"Invalid 'temperature': {temperature} is out of range; it must be between 0 and 1.",
                          param="temperature")
    messages: list[dict] = []
    origins: list[str] = []
    if body.get("system") is not None:
        messages.append({"role": "system", "content": _texts(body["system"], "system")})
        origins.append("system")
    turns = required(body, "messages")
    expect(turns, list, "messages", "an array")
    if not turns:
        raise invalid("Invalid 'messages': empty array; send at least one message.", param="messages",
                      code="empty_array")
    for i, m in enumerate(turns):
        for message in _turn(i, m):
            messages.append(message)
            origins.append(f"messages[{i}]")
    chat = {"messages": messages}
    for name in ("model", "max_tokens", "temperature", "top_p", "top_k", "stream", "syshax"):
        if name in body:
            chat[name] = body[name]
    if body.get("stop_sequences") is not None:
        chat["stop"] = expect(body["stop_sequences"], list, "stop_sequences", "an array of strings")
    tools = chat_tools(body, _tool)
    if tools is not None:
        chat["tools"] = tools
    _tool_choice(body, chat)
    thinking_field = _thinking(body, chat)
    _options(body, chat)
    return chat, Renames(_RULES, origins, thinking_field=thinking_field)


async def _stop_sequence(request: web.Request, finish: Finish, stops: tuple[str, ...]) -> str | None:
    """The stop sequence that ended the text, if one did. The engines finish with "stop" both at an
    end-of-generation token and at a stop string; the generated ids tell which (the first stop string in
    them is the one that ended it)."""
    if finish.reason != "stop" or finish.whole_calls or not stops or not finish.tokens:
        return None
    holder = request.app[VOCAB]
    vocab = await holder.get()
    if vocab.is_eog(finish.tokens[-1]):
        return None
    text = b"".join(holder.pieces.bytes(t) for t in finish.tokens).decode("utf-8", errors="replace")
    found = [(text.find(s), s) for s in stops if s in text]
    return min(found)[1] if found else None


def _stop_reason(finish: Finish, stop_sequence: str | None) -> str:
    if finish.whole_calls:  # a tool_use that max_tokens cut short ends with "max_tokens", as Anthropic's does
        return "tool_use"
    if stop_sequence is not None:
        return "stop_sequence"
    return "max_tokens" if finish.reason == "length" else "end_turn"


def _tool_use(call) -> dict:
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name, "input": {}}


async def _events(gen: Generation, message_id: str, steps: AsyncIterator[Step | None],
                  shown_thinking: bool = True) -> AsyncIterator[dict]:
    """Anthropic's stream events for one output, in order; the first comes with the engine's first token. A reasoning
    model's thinking is a thinking block before the text (its text left out with `shown_thinking` false: thinking
    display "omitted"); its signature is empty, as nothing here signs it."""
    await anext(steps)
    yield {"type": "message_start", "message": {
        "id": message_id, "type": "message", "role": "assistant", "model": gen.parsed.model, "content": [],
        "stop_reason": None,
        "stop_sequence": None, "usage": {"input_tokens": gen.accepted[0].prompt_tokens, "output_tokens": 0}}}
    yield {"type": "ping"}
    index = 0
    open_text = open_thought = False
    finish: Finish | None = None
    async for step in steps:
        if step is None:
            continue  # outputs.steps' first: the headers may go
        if step.thought:
            if not open_thought:
                open_thought = True
                yield {"type": "content_block_start", "index": index,
                       "content_block": {"type": "thinking", "thinking": "", "signature": ""}}
            if shown_thinking:
                yield {"type": "content_block_delta", "index": index,
                       "delta": {"type": "thinking_delta", "thinking": step.thought}}
        if step.finish is not None:
            finish = step.finish
        piece = step.answer
        if not (piece or step.bare):
            continue
        if open_thought:  # the thinking ended where the answer begins
            open_thought = False
            yield {"type": "content_block_stop", "index": index}
            index += 1
        if not open_text:
            open_text = True
            yield {"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}}
        if piece:
            yield {"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": piece}}
    assert finish is not None  # the steps end with the choice's Finish
    if open_thought or open_text:
        yield {"type": "content_block_stop", "index": index}
        index += 1
    for call in finish.calls:
        yield {"type": "content_block_start", "index": index, "content_block": _tool_use(call)}
        if call.arguments:  # the SDK parses what it has after each delta: an empty one would be no JSON
            yield {"type": "content_block_delta", "index": index,
                   "delta": {"type": "input_json_delta", "partial_json": call.arguments}}
        yield {"type": "content_block_stop", "index": index}
        index += 1
    stop = await _stop_sequence(gen.request, finish, gen.parsed.generate.stop)
    yield {"type": "message_delta", "delta": {"stop_reason": _stop_reason(finish, stop), "stop_sequence": stop},
           "usage": {"input_tokens": finish.prompt_tokens, "output_tokens": finish.completion_tokens,
                     # prompt tokens whose KV came from the prefix cache
                     "cache_read_input_tokens": finish.cached_tokens, "cache_creation_input_tokens": 0},
           "syshax": gen.route}
    yield {"type": "message_stop"}


async def _folded(events: AsyncIterator[dict]) -> dict:
    """The Message the events describe, as the JSON answer gives it."""
    message: dict = {}
    partial: dict[int, str] = {}
    async for event in events:
        kind = event["type"]
        if kind == "message_start":
            message = event["message"]
        elif kind == "content_block_start":
            message["content"].append(dict(event["content_block"]))
        elif kind == "content_block_delta":
            delta = event["delta"]
            if delta["type"] == "text_delta":
                message["content"][event["index"]]["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                message["content"][event["index"]]["thinking"] += delta["thinking"]
            else:
                partial[event["index"]] = partial.get(event["index"], "") + delta["partial_json"]
        elif kind == "content_block_stop" and event["index"] in partial:
            # a tool_use max_tokens cut short holds what arrived whole, as the SDK reads the stream
            message["content"][event["index"]]["input"] = partial_object(partial[event["index"]])
        elif kind == "message_delta":
            message |= event["delta"] | {"usage": event["usage"], "syshax": event["syshax"]}
    return message


def _failed(exc: APIError, sent: int) -> dict:
    return exc.anthropic_body()


async def _respond(gen: Generation, body: dict) -> web.StreamResponse:
    message_id = f"msg_{uuid.uuid4().hex}"
    shown_thinking = (body.get("thinking") or {}).get("display") != "omitted"
    async with aclosing(gen.steps()) as steps:
        events = _events(gen, message_id, steps, shown_thinking)
        if gen.parsed.stream:
            return await gen.stream(events, sse.Framing(sse.typed, _failed))
        message = await _folded(events)
    return web.json_response(message, headers={"X-Syshax-Route": message["syshax"]["route"]})


@routes.post("/v1/messages")
async def create_message(request: web.Request) -> web.StreamResponse:
    return await serve(request, Translated(request, to_chat, _respond))


@routes.post("/v1/messages/count_tokens")
async def count_tokens(request: web.Request) -> web.Response:
    """The prompt's tokens as the engines would see them: the chat template rendered with the tools."""
    cfg = request.app[STATE].config
    chat, renames = to_chat(await read_body(request), counting=True)
    try:
        parsed = parse_chat(chat, request.app[MODEL_NAME], cfg.max_messages)
        vocab = await request.app[VOCAB].get()
        try:
            tokens = await asyncio.to_thread(vocab.prompt_tokens, parsed.generate)
        except ValueError as exc:  # the chat template refused the messages
            raise invalid(str(exc), param="messages", code="invalid_prompt") from None
    except APIError as exc:
        raise renames.apply(exc) from None
    return web.json_response({"input_tokens": len(tokens)})
