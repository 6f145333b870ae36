"""POST /v1/responses: OpenAI's Responses API (the Agents SDK's default), stateless, over the chat pipeline.

The body becomes a chat body (instructions -> a system message, input items -> messages,
function tools, text.format -> response_format, reasoning.effort -> reasoning_effort) that parse_chat
checks; the output is read as thinking, text and tool calls (api/core/outputs.py) and written as the Responses
API's typed events: a reasoning model's thinking is a `reasoning` item before the message, as OpenAI's
(its text as `reasoning_text` content; no summaries are made). A JSON answer is the `response` of the last
event a stream would send.

Stateless: syshaxd keeps no store of responses or conversations, so `previous_response_id`,
`conversation` and `item_reference` items are a 400 that says to send the whole conversation
in `input` (the prefix cache still reuses the earlier turns' KV). `store` is accepted and the
answer says `"store": false`, as vLLM does without its response store.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from aiohttp import web

from syshaxd.api.core import fields, sse
from syshaxd.api.core.chat_translation import (TOOL_RULES, Renames, Translated, chat_tool, chat_tools, expect, refuse,
                                               required, text_parts)
from syshaxd.api.core.errors import APIError, invalid, one_of
from syshaxd.api.core.fields import check_fields
from syshaxd.api.core.generation import Generation, serve
from syshaxd.api.core.outputs import Finish, Step
from syshaxd.api.core.reasoning import EFFORTS

routes = web.RouteTableDef()

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text")
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
SUMMARIES = ("auto", "concise", "detailed")  # reasoning.summary: accepted; the thinking itself is given, not a summary

# chat's names for what this endpoint calls otherwise (error params and messages)
_RULES = [
    (r"(?<![\w.\[])messages(?![\w\[])", "input"),
    (r"(?<![\w.])max_completion_tokens\b|(?<![\w.])max_tokens\b", "max_output_tokens"),
    (r"response_format\.json_schema\.(schema|name|strict)", r"text.format.\1"),
    (r"response_format(\.json_schema)?", "text.format"),
    (r"(?<![\w.])reasoning_effort\b", "reasoning.effort"),
    *TOOL_RULES,
]


def _text_of(content: Any, where: str) -> str:
    return text_parts(content, where, TEXT_PARTS)


def _thought(item: dict, at: str) -> str:
    """A reasoning item's text: its reasoning_text content, or where it has none (OpenAI's own items carry only a
    summary and encrypted content) its summary."""
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key)
        if parts is None:
            continue
        expect(parts, list, f"{at}.{key}", "an array")
        texts = []
        for j, part in enumerate(parts):
            where = f"{at}.{key}[{j}]"
            expect(part, dict, where, "an object")
            if part.get("type") != kind:
                raise invalid(f"Invalid '{where}.type': {part.get('type')!r}; expected {kind!r}.",
                              param=f"{where}.type")
            texts.append(expect(required(part, "text", where), str, f"{where}.text", "a string"))
        if texts:
            return "".join(texts)
    return ""


def _messages(body: dict) -> tuple[list[dict], list[str]]:
    """The chat messages of instructions + input, and for each the field of the body it came from. A reasoning item
    goes with the assistant turn after it, as its thinking (`reasoning_content`, which some templates render)."""
    messages: list[dict] = []
    origins: list[str] = []
    thought: tuple[str, str] | None = None  # (the field, its text) of a reasoning item waiting for its turn
    instructions = body.get("instructions")
    if instructions is not None:
        messages.append({"role": "system", "content": expect(instructions, str, "instructions", "a string")})
        origins.append("instructions")
    items = required(body, "input")
    if isinstance(items, str):
        if not items:
            raise invalid("Invalid 'input': empty string. Send the user's text, or input items.", param="input")
        items = [{"role": "user", "content": items}]
    expect(items, list, "input", "a string or an array of input items")
    if not items:
        raise invalid("Invalid 'input': empty array. Send a string or at least one input item.", param="input",
                      code="empty_array")
    for i, item in enumerate(items):
        at = f"input[{i}]"
        expect(item, dict, at, "an object")
        kind = item.get("type", "message" if "role" in item else None)
        if thought is not None and not (kind == "function_call" or (kind == "message"
                                                                     and item.get("role") == "assistant")):
            raise invalid(f"Invalid '{thought[0]}': a reasoning item goes right before the assistant message or "
                          "function_call it led to.", param=thought[0])
        if kind == "reasoning":
            thought = (at, _thought(item, at))
            continue
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise invalid(f"Invalid '{at}.role': {role!r}; it must be one of {', '.join(ROLES)}.",
                              param=f"{at}.role")
            messages.append({"role": role, "content": _text_of(required(item, "content", at), f"{at}.content")})
            if thought is not None:
                messages[-1]["reasoning_content"], thought = thought[1], None
        elif kind == "function_call":
            call = {"id": expect(required(item, "call_id", at), str, f"{at}.call_id", "a string"), "type": "function",
                    "function": {"name": expect(required(item, "name", at), str, f"{at}.name", "a string"),
                                 "arguments": expect(required(item, "arguments", at), str, f"{at}.arguments",
                                                     "a string of JSON")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and thought is None:  # text then calls: one turn
                last.setdefault("tool_calls", []).append(call)
                continue
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            if thought is not None:
                messages[-1]["reasoning_content"], thought = thought[1], None
        elif kind == "function_call_output":
            messages.append({"role": "tool",
                             "tool_call_id": expect(required(item, "call_id", at), str, f"{at}.call_id", "a string"),
                             "content": _text_of(required(item, "output", at), f"{at}.output")})
        elif kind == "item_reference":
            raise refuse(f"{at}.type", "item_reference needs stored items, and syshaxd keeps none; send the item "
                                       "itself.")
        else:
            raise invalid(f"Invalid '{at}.type': {kind!r}; this server reads {', '.join(ITEM_TYPES)} items "
                          "(hosted tool calls and files are not supported).", param=f"{at}.type")
        origins.append(at)
    if thought is not None:
        raise invalid(f"Invalid '{thought[0]}': a reasoning item goes right before the assistant message or "
                      "function_call it led to.", param=thought[0])
    return messages, origins


def _tool(at: str, tool: dict) -> dict:
    if tool.get("type") != "function":
        raise invalid(f"Invalid '{at}.type': {tool.get('type')!r}; only 'function' tools are supported "
                      "(this server runs no hosted tools: web search, file search, code interpreter, ...).",
                      param=f"{at}.type")
    return chat_tool(tool.get("name"), tool.get("description"), tool.get("parameters"))


def _tool_choice(body: dict) -> Any:
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise invalid(f"Invalid 'tool_choice.type': {choice.get('type')!r}; expected 'function' (or tool_choice "
                          "'none', 'auto', 'required').", param="tool_choice.type")
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(body: dict) -> dict | None:
    text = body.get("text")
    if text is None:
        return None
    expect(text, dict, "text", "an object")
    fmt = text.get("format")
    if fmt is None:
        return None
    expect(fmt, dict, "text.format", "an object")
    if fmt.get("type") != "json_schema":
        return {"type": fmt.get("type")}
    spec = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}


def _stateless(body: dict) -> None:
    """What a stateful server would answer from its store: here a 400 that says what to send instead."""
    for name in ("previous_response_id", "conversation"):
        if body.get(name) is not None:
            raise refuse(name, "syshaxd keeps no store of responses or conversations. Send the whole conversation "
                               "in 'input' (earlier outputs and function_call_output items); the prefix cache "
                               "reuses the earlier turns' KV.")
    if body.get("background"):
        raise refuse("background", "responses run while the request is open; stream them instead.")
    if body.get("include"):
        items = expect(body["include"], list, "include", "an array")
        raise refuse("include[0]", f"{items[0]!r} is not served; send include: [] or leave it out.")
    if body.get("truncation") not in (None, "disabled"):
        raise refuse("truncation", "only 'disabled': an input that does not fit the context is a 400, never cut.")
    if body.get("metadata") is not None:
        expect(body["metadata"], dict, "metadata", "an object")
    options = body.get("stream_options")
    if options is not None:
        expect(options, dict, "stream_options", "an object")


def _reasoning_effort(body: dict, chat: dict) -> str:
    """reasoning {effort, summary}: effort as chat's reasoning_effort ("none": no thinking); the field that asks the
    model to think ("" when none does)."""
    reasoning = body.get("reasoning")
    if reasoning is None:
        return ""
    expect(reasoning, dict, "reasoning", "an object")
    summary = reasoning.get("summary")
    if summary is not None:
        one_of(summary, SUMMARIES, "reasoning.summary")
    effort = reasoning.get("effort")
    if effort is None:
        return ""
    chat["reasoning_effort"] = one_of(effort, EFFORTS, "reasoning.effort")
    return "" if effort == "none" else "reasoning.effort"


def to_chat(body: dict) -> tuple[dict, Renames]:
    """The chat body that means what the Responses body means, and how to name chat's errors back."""
    check_fields(body, fields.RESPONSES)
    _stateless(body)
    messages, origins = _messages(body)
    chat: dict[str, Any] = {"messages": messages}
    thinking_field = _reasoning_effort(body, chat)
    for name in ("model", "temperature", "top_p", "top_k", "seed", "stream", "parallel_tool_calls", "syshax"):
        if name in body:
            chat[name] = body[name]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    tools = chat_tools(body, _tool)
    if tools is not None:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body)
    fmt = _response_format(body)
    if fmt is not None:
        chat["response_format"] = fmt
    return chat, Renames(_RULES, origins, thinking_field=thinking_field)


class _Shape:
    """The Response object of one request: what it echoes of the body, and its ids."""

    def __init__(self, body: dict, model: str) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.body = body
        self.model = model

    def tools(self) -> list[dict]:
        return [{"type": "function", "name": t.get("name"), "description": t.get("description"),
                 "parameters": t.get("parameters"), "strict": t.get("strict", True)}
                for t in self.body.get("tools") or ()]

    def response(self, status: str, output: list[dict], finish: Finish | None = None, route: dict | None = None
                 ) -> dict:
        b = self.body
        out = {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
            "model": self.model, "output": output,
            "parallel_tool_calls": b.get("parallel_tool_calls", True) is not False,
            "previous_response_id": None, "store": False,  # stateless: nothing is stored
            "reasoning": ({"effort": None, "summary": None} | b["reasoning"]) if b.get("reasoning") else None,
            "temperature": b.get("temperature", 1.0), "top_p": b.get("top_p", 1.0),
            "text": {"format": (b.get("text") or {}).get("format") or {"type": "text"}},
            "tool_choice": b.get("tool_choice") or "auto", "tools": self.tools(), "truncation": "disabled",
            "metadata": b.get("metadata") or {}, "user": b.get("user"), "service_tier": "default",
            "background": False, "usage": None,
        }
        if finish is not None:
            out["completed_at"] = int(time.time())
            out["usage"] = {"input_tokens": finish.prompt_tokens,
                            # prompt tokens whose KV came from the prefix cache
                            "input_tokens_details": {"cached_tokens": finish.cached_tokens, "cache_write_tokens": 0},
                            "output_tokens": finish.completion_tokens,
                            "output_tokens_details": {"reasoning_tokens": finish.reasoning_tokens},
                            "total_tokens": finish.prompt_tokens + finish.completion_tokens}
        if route is not None:
            out["syshax"] = route
        return out


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message(item_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [_text_part(text)]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def _call(item_id: str, call, arguments: str, status: str) -> dict:
    return {"id": item_id, "type": "function_call", "call_id": call.id, "name": call.name, "arguments": arguments,
            "status": status}


def _reasoning_part(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def _reasoning(item_id: str, text: str | None, status: str) -> dict:
    """A reasoning item, OpenAI's shape: the model's thinking as reasoning_text content (no summaries are made)."""
    content = [] if text is None else [_reasoning_part(text)]
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


async def _events(shape: _Shape, steps: AsyncIterator[Step | None], gen: Generation) -> AsyncIterator[dict]:
    """The Responses API's events for one output, in order; the first comes with the engine's first token. A reasoning
    model's thinking is a reasoning item before the message."""
    await anext(steps)
    seq = itertools.count()

    def event(kind: str, **fields) -> dict:
        return {"type": kind, "sequence_number": next(seq)} | fields

    yield event("response.created", response=shape.response("in_progress", []))
    yield event("response.in_progress", response=shape.response("in_progress", []))
    output: list[dict] = []
    thought_id, msg_id = f"rs_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
    thought: list[str] | None = None  # the thinking, while its item is open
    text: list[str] | None = None  # the message's text, once it has begun

    def thought_done(status: str) -> list[dict]:
        """The events that close the reasoning item."""
        whole = "".join(thought or ())
        at = {"item_id": thought_id, "output_index": len(output), "content_index": 0}
        output.append(_reasoning(thought_id, whole, status))
        return [event("response.reasoning_text.done", **at, text=whole),
                event("response.content_part.done", **at, part=_reasoning_part(whole)),
                event("response.output_item.done", output_index=at["output_index"], item=output[-1])]

    finish: Finish | None = None
    async for step in steps:
        if step is None:
            continue  # outputs.steps' first: the headers may go
        if step.thought:
            at = {"item_id": thought_id, "output_index": len(output), "content_index": 0}
            if thought is None:
                thought = []
                yield event("response.output_item.added", output_index=len(output),
                            item=_reasoning(thought_id, None, "in_progress"))
                yield event("response.content_part.added", **at, part=_reasoning_part(""))
            thought.append(step.thought)
            yield event("response.reasoning_text.delta", **at, delta=step.thought)
        if step.finish is not None:
            finish = step.finish
        piece = step.answer
        if not (piece or step.bare):
            continue
        if text is None:
            if thought is not None:  # the thinking ended where the answer begins
                for done in thought_done("completed"):
                    yield done
                thought = None
            text = []
            where = {"item_id": msg_id, "output_index": len(output), "content_index": 0}
            yield event("response.output_item.added", output_index=len(output),
                        item=_message(msg_id, None, "in_progress"))
            yield event("response.content_part.added", **where, part=_text_part(""))
        if piece:
            text.append(piece)
            yield event("response.output_text.delta", **where, delta=piece, logprobs=[])
    assert finish is not None  # the steps end with the choice's Finish
    status = "incomplete" if finish.reason == "length" and not finish.whole_calls else "completed"
    if thought is not None:  # all thinking: max_output_tokens ended it there, or the model ended with it
        for done in thought_done(status):
            yield done
    if text is not None:
        whole = "".join(text)
        yield event("response.output_text.done", **where, text=whole, logprobs=[])
        yield event("response.content_part.done", **where, part=_text_part(whole))
        output.append(_message(msg_id, whole, status))
        yield event("response.output_item.done", output_index=where["output_index"], item=output[-1])
    for call in finish.calls:
        index, item_id = len(output), f"fc_{uuid.uuid4().hex}"
        yield event("response.output_item.added", output_index=index, item=_call(item_id, call, "", "in_progress"))
        if call.arguments:  # a call cut before its arguments has none
            yield event("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                        delta=call.arguments)
        yield event("response.function_call_arguments.done", item_id=item_id, output_index=index, name=call.name,
                    arguments=call.arguments)
        # max_output_tokens cut it: its arguments as far as they got, as OpenAI answers it
        output.append(_call(item_id, call, call.arguments, "completed" if call.complete else "incomplete"))
        yield event("response.output_item.done", output_index=index, item=output[-1])
    yield event(f"response.{status}", response=shape.response(status, output, finish, gen.route))


def _failed(shape: _Shape) -> Callable[[APIError, int], dict]:
    def failed(exc: APIError, sent: int) -> dict:
        response = shape.response("failed", [])
        response["error"] = {"code": exc.code or "server_error", "message": exc.message}
        return {"type": "response.failed", "sequence_number": sent, "response": response}
    return failed


async def _respond(gen: Generation, body: dict) -> web.StreamResponse:
    shape = _Shape(body, gen.parsed.model)
    async with aclosing(gen.steps()) as steps:
        events = _events(shape, steps, gen)
        if gen.parsed.stream:
            return await gen.stream(events, sse.Framing(sse.typed, _failed(shape)))
        last: dict = {}
        async for last in events:  # the JSON answer is the response the stream's last event carries
            pass
    return web.json_response(last["response"], headers={"X-Syshax-Route": last["response"]["syshax"]["route"]})


@routes.post("/v1/responses")
async def create_response(request: web.Request) -> web.StreamResponse:
    return await serve(request, Translated(request, to_chat, _respond))
