"""What the Responses and Messages APIs share: each translates its body into a chat-completions body.

parse_chat (api/core/validate.py) then checks it as it checks every chat request, so the two APIs get
the same sampling, tools and grammars as chat. Errors name the chat field; `Renames` puts them
back into the endpoint's own names (`response_format.json_schema.schema` -> `text.format.schema`),
so that a client is told about the field it sent.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from aiohttp import web

from syshaxd.api.core.app_keys import MODEL_NAME, STATE
from syshaxd.api.core.errors import APIError, invalid
from syshaxd.api.core.generation import Generation
from syshaxd.api.core.validate import ParsedRequest, parse_chat, type_error

Translate = Callable[[dict], tuple[dict, "Renames"]]
# respond(gen, body): the endpoint's answer to the started request, from the body the client sent
Respond = Callable[[Generation, dict], Awaitable[web.StreamResponse]]


def expect(value: Any, kind: type | tuple[type, ...], name: str, expected: str) -> Any:
    """value if it is of `kind` (a boolean is not a number here); else the 400 naming `name`."""
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise type_error(name, expected, value)
    return value


def required(obj: dict, key: str, where: str = "") -> Any:
    name = f"{where}.{key}" if where else key
    if obj.get(key) is None:
        raise invalid(f"Missing required parameter: '{name}'.", param=name, code="missing_required_parameter")
    return obj[key]


def refuse(name: str, why: str) -> APIError:
    """The 400 for a field this server knows but does not serve."""
    return invalid(f"'{name}' is not supported by this server: {why}", param=name, code="unsupported_parameter")


@dataclass
class Renames:
    """Chat field names -> the endpoint's: rules applied in order to an error's param and message."""

    rules: Sequence[tuple[str, str | Callable[[re.Match], str]]]
    origins: list[str] = field(default_factory=list)  # chat message i came from this field of the body
    origin_prefix: str = "messages"
    # the endpoint's field that asked the model to think (Messages' `thinking`, Responses' `reasoning.effort`): a
    # model whose template has no thinking answers 400 naming it (reasoning.Thinking.settle)
    thinking_field: str = ""

    def _name(self, text: str) -> str:
        text = re.sub(r"(?<![\w.])messages\[(\d+)\]", lambda m: self._origin(int(m.group(1))), text)
        for pattern, to in self.rules:
            text = re.sub(pattern, to, text)
        return text

    def _origin(self, i: int) -> str:
        return self.origins[i] if i < len(self.origins) else f"{self.origin_prefix}"

    def apply(self, exc: APIError) -> APIError:
        exc.message = self._name(exc.message)
        if exc.param:
            exc.param = self._name(exc.param)
        exc.args = (exc.message,)
        return exc


# chat's tool names -> the flat tools of both endpoints (their "function" object is the tool itself)
TOOL_RULES = [
    (r"tools\[(\d+)\]\.function\.", r"tools[\1]."),
    (r"tools\[(\d+)\]\.function\b", r"tools[\1]"),
    (r"tool_choice\.function\.name", "tool_choice.name"),
]


def text_parts(content: Any, where: str, kinds: tuple[str, ...]) -> str:
    """A string, or the text of an array of parts whose type is one of `kinds`, joined."""
    if isinstance(content, str):
        return content
    expect(content, list, where, f"a string or an array of {' / '.join(kinds)} parts")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        expect(part, dict, at, "an object")
        if part.get("type") not in kinds:
            raise invalid(f"Invalid '{at}.type': {part.get('type')!r}; only text is read here ({', '.join(kinds)}): "
                          "images, documents, files and audio are not supported.", param=f"{at}.type")
        texts.append(expect(required(part, "text", at), str, f"{at}.text", "a string"))
    return "".join(texts)


def chat_tools(body: dict, one: Callable[[str, dict], dict]) -> list[dict] | None:
    """The request's tools in chat's shape, one(where, tool) reading each; None when it sends none."""
    tools = body.get("tools")
    if tools is None:
        return None
    expect(tools, list, "tools", "an array")
    return [one(f"tools[{i}]", expect(tool, dict, f"tools[{i}]", "an object")) for i, tool in enumerate(tools)]


def chat_tool(name: Any, description: Any, parameters: Any) -> dict:
    """One chat-shaped function tool from an endpoint's flat one; absent keys stay absent for parse_tools."""
    fn = {"name": name}
    if description is not None:
        fn["description"] = description
    if parameters is not None:
        fn["parameters"] = parameters
    return {"type": "function", "function": fn}


class Translated:
    """A request to an endpoint whose body becomes a chat body (generation.Endpoint): translated, checked as chat,
    answered by respond(gen, body); every error named in the endpoint's own fields."""

    def __init__(self, request: web.Request, translate: Translate, respond: Respond) -> None:
        self.request = request
        self.translate = translate
        self.answer = respond
        self.body: dict = {}
        self.renames: Renames | None = None  # known once the body is translated

    def parse(self, body: dict) -> ParsedRequest:
        self.body = body
        chat, self.renames = self.translate(body)  # its errors name the endpoint's fields already
        cfg = self.request.app[STATE].config
        parsed = parse_chat(chat, self.request.app[MODEL_NAME], cfg.max_messages)
        if self.renames.thinking_field and parsed.thinking is not None:  # parse_chat gives every chat one
            parsed = replace(parsed, thinking=replace(parsed.thinking, demanded_by=self.renames.thinking_field))
        return parsed

    def renamed(self, exc: APIError) -> APIError:
        return self.renames.apply(exc) if self.renames is not None else exc

    async def respond(self, gen: Generation) -> web.StreamResponse:
        return await self.answer(gen, self.body)
