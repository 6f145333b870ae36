"""Tool calling: check `tools` and `tool_choice`, build the grammar of a forced call, and find calls in output.

tool_choice "required" or a named function constrains the output to one JSON object
{"name": ..., "arguments": {...}} through a grammar (api/core/structured.py), so the call always parses
and its arguments match the function's schema. "auto" leaves the model free and parses what it
wrote: `<tool_call>{...}</tool_call>` blocks (Qwen2.5, Hermes, and the system note a template
without a tool format gets, gguf/chat.py) or, as Llama 3.1 answers, the whole output being one
JSON object {"name": ..., "parameters"/"arguments": ...} naming a given tool, or Mistral's
`[TOOL_CALLS][{"name": ..., "arguments": ...}, ...]` list of them.

A call's arguments are the model's own text of them, as OpenAI gives them. A call that max_tokens cut
short is still a call, as OpenAI answers one: its arguments as far as they got (not valid JSON), and
the choice keeps finish_reason "length"; only its name must be known (from the text, or the one
function allowed).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from json.decoder import scanstring  # type: ignore[attr-defined]  # the C scanner, not in typeshed

from syshaxd.api.core.errors import invalid
from syshaxd.api.core.fields import MAX_TOOLS, NAME_PATTERN
from syshaxd.api.core.structured import SchemaError, _check, schema_to_grammar

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3.1 may open a JSON call with it
MISTRAL_CALLS = "[TOOL_CALLS]"  # Mistral's calls follow it as a JSON list
_NAME = re.compile(NAME_PATTERN)  # the one declaration the OpenAPI document shows too
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CLOSE) + r"|$)", re.S)
_SPACE = re.compile(r"\s*")


def _skip_space(text: str, at: int = 0) -> int:
    """Where the whitespace from `at` ends."""
    found = _SPACE.match(text, at)
    assert found is not None  # \s* matches anywhere, if only nothing
    return found.end()


_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it; a cut call's as far as it got
    complete: bool = True  # False: the output ended inside the call (max_tokens)

    def to_json(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index} | call


@dataclass(frozen=True)
class Tools:
    """A chat request's tools, as they go into the prompt, and how the output is read."""

    tools: tuple[dict, ...]  # {"type": "function", "function": {...}}, for the chat template
    choice: str  # "auto", "required", or the one function's name ("none" never makes a Tools)
    forced: bool  # required or named: the output is one call, by grammar
    parallel: bool = True

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t["function"]["name"] for t in self.tools)

    @property
    def allowed(self) -> frozenset[str]:
        """The functions the output may call: the one tool_choice names, or any."""
        return self.names if self.choice in ("auto", "required") else frozenset((self.choice,))


def _param(i: int, key: str = "") -> str:
    return f"tools[{i}]" + (f".{key}" if key else "")


def _function(i: int, tool) -> dict:
    if not isinstance(tool, dict):
        raise invalid(f"Invalid type for '{_param(i)}': expected an object.", param=_param(i), code="invalid_type")
    if tool.get("type") != "function":
        raise invalid(f"Invalid '{_param(i, 'type')}': {tool.get('type')!r}; only 'function' tools are supported.",
                      param=_param(i, "type"))
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise invalid(f"Missing required parameter: '{_param(i, 'function')}'.", param=_param(i, "function"),
                      code="missing_required_parameter")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise invalid(f"Invalid '{_param(i, 'function.name')}': it must be 1 to 64 of a-z, A-Z, 0-9, _ and -.",
                      param=_param(i, "function.name"))
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise invalid(f"Invalid type for '{_param(i, 'function.description')}': expected a string.",
                      param=_param(i, "function.description"), code="invalid_type")
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise invalid(f"Invalid type for '{_param(i, 'function.strict')}': expected a boolean.",
                      param=_param(i, "function.strict"), code="invalid_type")
    params = fn.get("parameters")
    if params is None:  # OpenAI: no parameters means a function that takes none
        params = {"type": "object", "properties": {}}
    where = _param(i, "function.parameters")
    if not isinstance(params, dict):
        raise invalid(f"Invalid type for '{where}': expected a JSON Schema object.", param=where, code="invalid_type")
    try:
        _check(params, where)
    except SchemaError as exc:
        raise invalid(f"Invalid '{exc.where}': {exc}. A forced tool call is constrained by a grammar built from "
                      "the schema, and this server refuses what it cannot enforce.", param=where,
                      code="unsupported_schema") from None
    out = {"name": name, "parameters": params}
    if fn.get("description"):
        out["description"] = fn["description"]
    return {"type": "function", "function": out}


def parse_tools(body: dict) -> Tools | None:
    """The request's tools, or None when there are none (or tool_choice is "none")."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    if raw is not None and not isinstance(raw, list):
        raise invalid("Invalid type for 'tools': expected an array.", param="tools", code="invalid_type")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid("Invalid type for 'parallel_tool_calls': expected a boolean.", param="parallel_tool_calls",
                      code="invalid_type")
    if not raw:
        if choice is not None and choice != "none":
            raise invalid("Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are "
                          "specified.", param="tool_choice")
        return None
    if len(raw) > MAX_TOOLS:
        raise invalid(f"Invalid 'tools': array too long. Expected an array with maximum length {MAX_TOOLS}, but got an "
                      f"array with length {len(raw)} instead.", param="tools", code="array_above_max_length")
    tools = tuple(_function(i, t) for i, t in enumerate(raw))
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise invalid("Invalid 'tools': function names must be unique.", param="tools")
    if choice is None or choice in ("auto", "required", "none"):
        choice = choice or "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise invalid("Invalid 'tool_choice': expected 'none', 'auto', 'required' or "
                          '{"type": "function", "function": {"name": ...}}.', param="tool_choice")
        if name not in names:
            raise invalid(f"Invalid 'tool_choice': function {name!r} is not among the request's tools.",
                          param="tool_choice.function.name")
        choice = name
    else:
        raise invalid(f"Invalid 'tool_choice': {choice!r}; expected 'none', 'auto', 'required' or "
                      '{"type": "function", "function": {"name": ...}}.', param="tool_choice")
    if choice == "none":
        return None
    return Tools(tools, choice, forced=choice != "auto", parallel=parallel is not False)


def call_grammar(tools: Tools) -> str:
    """The grammar of one call: {"name": <one of the allowed names>, "arguments": <that function's schema>}."""
    fns = [t["function"] for t in tools.tools if tools.choice in ("required", t["function"]["name"])]
    branches = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
                 "required": ["name", "arguments"], "additionalProperties": False} for f in fns]
    schema = branches[0] if len(branches) == 1 else {"anyOf": branches}
    try:
        return schema_to_grammar(schema, "tools")
    except SchemaError as exc:  # every parameters schema was checked; this is the converter failing
        raise invalid(f"Invalid 'tools': {exc}.", param="tools", code="unsupported_schema") from None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class _Member:
    """One member of a JSON object as it was written: the value's own text, whole or cut short."""

    key: str
    raw: str
    whole: bool


def _members(text: str) -> tuple[list[_Member], int | None]:
    """The members of the JSON object `text` is, and where it closed (None: it did not). Parsing stops at the first
    member that does not arrive whole; a value cut short is kept as far as it got."""
    members: list[_Member] = []
    i = _skip_space(text)
    if not text.startswith("{", i):
        return members, None
    i = _skip_space(text, i + 1)
    if text.startswith("}", i):
        return members, i + 1
    while text.startswith('"', i):
        try:
            key, i = scanstring(text, i + 1)
        except ValueError:  # the key itself is cut
            return members, None
        i = _skip_space(text, i)
        if not text.startswith(":", i):
            return members, None
        start = _skip_space(text, i + 1)
        try:
            end = _DECODER.raw_decode(text, start)[1]
        except ValueError:
            members.append(_Member(key, text[start:], whole=False))
            return members, None
        members.append(_Member(key, text[start:end], whole=True))
        i = _skip_space(text, end)
        if text.startswith("}", i):
            return members, i + 1
        if not text.startswith(",", i):
            return members, None
        i = _skip_space(text, i + 1)
    return members, None


def _cut_string(raw: str) -> str:
    """The characters a JSON string cut short holds (an escape cut in two is left out)."""
    for end in range(len(raw), max(len(raw) - 6, 0), -1):
        try:
            return json.loads(raw[:end] + '"')
        except ValueError:
            continue
    return ""


def _name(member: _Member | None, names: frozenset[str], known: bool) -> str | None:
    """The function a call names: its whole name, or one cut short that fits one function only; with no name
    written yet, the one function allowed when the text is `known` to be a call."""
    if member is None:
        return next(iter(names)) if known and len(names) == 1 else None
    if member.whole:
        name = json.loads(member.raw)
        return name if isinstance(name, str) and name in names else None
    if not member.raw.startswith('"'):
        return None
    fits = [n for n in names if n.startswith(_cut_string(member.raw))]
    return fits[0] if len(fits) == 1 else None


def _arguments(member: _Member | None, closed: bool) -> str | None:
    """The arguments' text as OpenAI sends it (None: not a call's): an object's text as the model wrote it (some
    models write it as a JSON string instead), or as far as it got."""
    if member is None:
        return "{}" if closed else ""
    if not member.whole:
        return _cut_string(member.raw) if member.raw.startswith('"') else member.raw
    args = json.loads(member.raw)
    if isinstance(args, str):  # the arguments as a string of JSON, as OpenAI sends them
        try:
            return args if isinstance(json.loads(args), dict) else None
        except ValueError:
            return None
    return member.raw if isinstance(args, dict) else None


def _call(text: str, names: frozenset[str], cut: bool, known: bool = False) -> ToolCall | None:
    """The call a JSON object {"name": ..., "arguments" | "parameters": {...}} makes, if it names a given tool. With
    `cut` the output ended early, and an object that did not close is a call as far as it got (`known`: the text is
    a call whatever it holds, so that the one function allowed is the one it calls)."""
    if text.strip() and not text.lstrip().startswith("{"):
        return None
    members, end = _members(text)
    if end is not None and text[end:].strip():
        return None
    if end is None and not cut:
        return None
    by_key = {m.key: m for m in members}
    name = _name(by_key.get("name"), names, known)
    arguments = _arguments(by_key.get("arguments", by_key.get("parameters")), end is not None)
    if name is None or arguments is None:
        return None
    return ToolCall(new_call_id(), name, arguments, complete=end is not None)


def _cut_close(text: str) -> str:
    """text without the start of a closing </tool_call> that max_tokens cut."""
    for n in range(len(CLOSE) - 1, 0, -1):
        if text.endswith(CLOSE[:n]):
            return text[:-n]
    return text


def parse_output(text: str, tools: Tools, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) from a finished output; `cut`: max_tokens ended it, and the last call may be cut short.
    With no call found, the text is all content; but a forced output is a call or nothing, never JSON text."""
    if tools.forced:  # the grammar allows only the call: only a stop string or max_tokens ends it early
        call = _call(text, tools.allowed, cut=True, known=True)
        return None, [call] if call else []
    if OPEN in text:
        calls = []
        for block in _BLOCK.findall(_cut_close(text) if cut else text):
            call = _call(block, tools.names, cut, known=True)
            if call is None:  # not a call we can give back: the text stays text
                return text, []
            calls.append(call)
        content = text[:text.index(OPEN)].strip() or None
        return content, calls if tools.parallel else calls[:1]
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    if body.startswith((MISTRAL_CALLS, "[")):  # the marker is a control token, which the text may leave out
        calls = _mistral_calls(body.removeprefix(MISTRAL_CALLS), tools.names)
        if calls:
            return None, calls if tools.parallel else calls[:1]
        return text, []
    if body.startswith("{"):
        call = _call(body, tools.names, cut)
        if call is not None:
            return None, [call]
    return text, []


def _mistral_calls(text: str, names: frozenset[str]) -> list[ToolCall]:
    """Mistral's calls, `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` as its templates write them: every one
    whole and naming a given tool, or none (the text stays text). Each call keeps the model's own text."""
    body = text.strip()
    if not body.startswith("["):
        return []
    calls, i = [], _skip_space(body, 1)
    while True:
        try:
            end = _DECODER.raw_decode(body, i)[1]
        except ValueError:
            return []
        call = _call(body[i:end], names, cut=False)
        if call is None:
            return []
        calls.append(call)
        i = _skip_space(body, end)
        if body.startswith("]", i):
            return calls if not body[i + 1:].strip() else []
        if not body.startswith(",", i):
            return []
        i = _skip_space(body, i + 1)


def finish_reason(reason: str, calls: list[ToolCall]) -> str:
    """A choice's finish_reason: "tool_calls" when it is whole calls; a call cut short keeps the engine's ("length"),
    as OpenAI answers it."""
    return "tool_calls" if calls and all(c.complete for c in calls) else reason


def partial_object(text: str) -> dict:
    """What the text of a JSON object, cut anywhere, holds: the members that arrived whole (objects and arrays as far
    as they got; a string, number or literal cut short left out), as the anthropic SDK reads a cut tool input."""
    ends: list[tuple[int, str]] = []  # (where the text may be cut, the brackets that then close it)
    opened: list[str] = []
    in_string = escaped = False
    for i, c in enumerate(text):
        if in_string:
            escaped, in_string = (False, True) if escaped else (c == "\\", c != '"')
        elif c == '"':
            in_string = True
        elif c in "{[":
            opened.append("}" if c == "{" else "]")
            ends.append((i + 1, "".join(reversed(opened))))
        elif c in "}]" and opened:
            opened.pop()
        elif c == ",":
            ends.append((i, "".join(reversed(opened))))
    if not in_string:
        ends.append((len(text), "".join(reversed(opened))))
    for end, closing in reversed(ends):
        try:
            obj = json.loads(text[:end] + closing)
        except ValueError:
            continue
        return obj if isinstance(obj, dict) else {}
    return {}


class ToolStream:
    """Which streamed text can go out as content now, and which must wait: what could be a tool call.

    Forced calls hold everything (it is one JSON call). In auto mode text goes out until a
    `<tool_call>` may be starting; and an output that begins with `{` (or Llama's <|python_tag|>)
    is held whole, since it may be a JSON call. At the end, parse_output decides over all the text.
    """

    def __init__(self, tools: Tools) -> None:
        self.tools = tools
        self.text = ""
        self.sent = 0  # characters of text already sent as content

    def feed(self, piece: str) -> str:
        self.text += piece
        if self.tools.forced:
            return ""
        head = self.text.lstrip()
        if self.sent == 0 and (head.startswith("{") or PYTHON_TAG.startswith(head[:len(PYTHON_TAG)])
                               or head.startswith(PYTHON_TAG)):
            return ""
        end = self.text.find(OPEN, self.sent)
        if end == -1:
            end = len(self.text)
            for n in range(min(len(OPEN) - 1, len(self.text) - self.sent), 0, -1):
                if self.text.endswith(OPEN[:n]):
                    end -= n
                    break
        out = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        return out

    def finish(self, reason: str) -> tuple[str, list[ToolCall]]:
        """(content not yet sent, calls) once the output is complete, ended for `reason`."""
        content, calls = parse_output(self.text, self.tools, cut=reason == "length")
        if not calls:
            return ("" if content is None else self.text[self.sent:]), []
        # what went out was content before the call block; what is left of that goes now
        start = self.text.find(OPEN)
        return (self.text[self.sent:start] if start > self.sent else ""), calls
