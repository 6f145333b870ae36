"""What /openapi.json says chat and completions take is what their validation takes, field by field.

The request schemas are written from api/core/fields.py's declarations; this holds them to what parse_chat and
parse_completion actually do. For every field the document names, at the top level and in the objects it
declares (a message, a tool, stream_options, response_format, ...), a set of values of every JSON type (each
enum value and const of the document among them, each bound and one past it) is sent to validation and to the
document: both take a value or both refuse it, so that a type, an enum value, a range or a required key cannot
drift between them. Where a rule needs more than one field (top_logprobs needs logprobs) the value is tried
in a body that meets it; the few rules a JSON Schema cannot say (a grammar's syntax, best_of equal to n) are
listed in GAPS with their reason.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

import jsonschema
import pytest

from syshaxd.api.core.errors import APIError
from syshaxd.api.core.fields import CHAT_ROLES
from syshaxd.api.core.reasoning import EFFORTS, ReasoningFormat
from syshaxd.api.core.validate import parse_chat, parse_completion
from syshaxd.api.openapi import build_document
from syshaxd.config import MODES

MODEL = "served-model"
N_CTX = 4096
DOC = build_document(MODEL, N_CTX, list(MODES), False, False)
SCHEMAS = DOC["components"]["schemas"]

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": MODEL, "prompt": "hi"}

# values of every JSON type, tried at every field, and every word validation knows for a field that takes one of a
# few (the document's own enums and bounds are added per field)
WORDS = [*CHAT_ROLES, *MODES, *EFFORTS, *map(str, ReasoningFormat), "text", "json_object", "json_schema", "none",
         "auto", "required", "function"]
GENERIC: list[Any] = [None, True, False, 0, 1, -1, 0.5, "x", "", ["x"], [], [1], {}, {"k": "v"}, *WORDS]
# values that are good for a field whose rules the generic ones cannot meet (a grammar, a regex, a schema)
GOOD: dict[str, list[Any]] = {
    "grammar": ['root ::= "a"'], "guided_grammar": ['root ::= "a"'],
    "structured_outputs.grammar": ['root ::= "a"'],
    "guided_json": [{"type": "object"}, '{"type": "object"}'], "json_schema": [{"type": "object"}],
    "structured_outputs.json": [{"type": "object"}], "response_format.schema": [{"type": "object"}],
    "response_format.json_schema.schema": [{"type": "object"}],
    "response_format": [{"type": "text"}, {"type": "json_object"},
                        {"type": "json_schema", "json_schema": {"name": "a"}}],
    "structured_outputs": [{"regex": "a"}, {"choice": ["a"]}, {"json_object": True}],
    "tools": [[TOOL]], "tool_choice": ["auto", {"type": "function", "function": {"name": "f"}}],
    "stop": [["a", "b"], "a"], "chat_template_kwargs": [{"enable_thinking": False}],
    "prompt": [[1, 2], ["a", "b"], [[1], [2]]],
    "messages": [[{"role": "user", "content": "hi"}]],
    "messages[].content": [[{"type": "text", "text": "hi"}]],
    "messages[].tool_calls": [[{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]],
    "tools[].function.parameters": [{"type": "object", "properties": {}}],
}
# the other fields a value is tried beside, where a rule needs them
BESIDE: dict[str, dict] = {
    "stream_options": {"stream": True}, "stream_options.include_usage": {"stream": True},
    "top_logprobs": {"logprobs": True}, "min_tokens": {"ignore_eos": True},
    "tool_choice": {"tools": [TOOL]}, "tool_choice.type": {"tools": [TOOL]},
    "tool_choice.function": {"tools": [TOOL]}, "tool_choice.function.name": {"tools": [TOOL]},
}
# where a field sits, and the smallest good object around it (an assistant message: the most a message carries)
PARENTS: dict[str, tuple[list, Any]] = {
    "stream_options": (["stream_options"], {}),
    "syshax": (["syshax"], {}),
    "response_format": (["response_format"], {"type": "json_schema", "json_schema": {"name": "a"}}),
    "response_format.json_schema": (["response_format", "json_schema"], {"name": "a"}),
    "structured_outputs": (["structured_outputs"], {}),
    "messages[]": (["messages", 0], {"role": "assistant", "content": "hi", "tool_call_id": "c"}),
    "messages[].content[]": (["messages", 0, "content", 0], {"type": "text", "text": "hi"}),
    "messages[].tool_calls[]": (["messages", 0, "tool_calls", 0], {"id": "c", "type": "function",
                                                                   "function": {"name": "f", "arguments": "{}"}}),
    "messages[].tool_calls[].function": (["messages", 0, "tool_calls", 0, "function"], {"name": "f",
                                                                                         "arguments": "{}"}),
    "tools[]": (["tools", 0], TOOL),
    "tools[].function": (["tools", 0, "function"], {"name": "f"}),
    "tool_choice": (["tool_choice"], {"type": "function", "function": {"name": "f"}}),
    "tool_choice.function": (["tool_choice", "function"], {"name": "f"}),
    "chat_template_kwargs": (["chat_template_kwargs"], {}),
}
# a field read only beside another value of its object's fields
AROUND = {"response_format.schema": {"type": "json_object"}}
# (endpoint, field): values the document takes and validation refuses, for rules a JSON Schema does not say; the
# other way (validation taking what the document refuses) is never let pass
GAPS = {
    ("completions", "best_of"): "best_of other than n (1 here) is refused: no extra candidates are ranked",
    ("completions", "max_tokens"): "0 is taken only with echo: the prompt alone",
    ("chat", "min_tokens"): "above 0 only with ignore_eos and no stop; the answer then runs to max_tokens",
    ("completions", "min_tokens"): "above 0 only with ignore_eos and no stop; the answer then runs to max_tokens",
    ("chat", "tools"): "an empty array is no tools, and then tool_choice names none",
    ("chat", "tool_choice.function.name"): "the function it names must be among the tools",
    **{(endpoint, name): "a JSON Schema's keywords are checked (structured.py), JSON text parsed"
       for endpoint in ("chat", "completions")
       for name in ("guided_json", "json_schema", "structured_outputs.json", "response_format.schema",
                    "response_format.json_schema.schema")},
    **{(endpoint, name): "a grammar's syntax is checked (a root rule), a regex's too"
       for endpoint in ("chat", "completions")
       for name in ("grammar", "guided_grammar", "structured_outputs.grammar", "guided_regex",
                    "structured_outputs.regex")},
    ("chat", "tools[].function.parameters"): "a JSON Schema's keywords are checked (structured.py)",
}


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return {int: "integer", float: "number", str: "string", list: "array", dict: "object"}[type(value)]


def _validator(name: str):
    return jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": DOC["components"]})


def _schema_values(schema: dict) -> list[Any]:
    """The values a field's schema names: its enums and consts, and each bound with one past it."""
    out: list[Any] = []
    for s in schema.get("anyOf", []) + [schema]:
        out += list(s.get("enum", [])) + ([s["const"]] if "const" in s else [])
        for bound, step in (("minimum", -1), ("maximum", 1)):
            if bound in s:
                out += [s[bound], s[bound] + step]
        out += _schema_values(s["items"])[:2] if isinstance(s.get("items"), dict) and "anyOf" not in s else []
    return out


def _fields(schema: dict, prefix: str = "") -> list[tuple[str, dict]]:
    """(dotted name, schema) of every declared field, through the objects and arrays of objects the document
    declares."""
    out = []
    for name, sub in schema.get("properties", {}).items():
        dotted = f"{prefix}{name}"
        out.append((dotted, sub))
        for branch in sub.get("anyOf", [sub]):
            if branch.get("type") == "object" and "properties" in branch:
                out += _fields(branch, dotted + ".")
            if branch.get("type") == "array" and isinstance(branch.get("items"), dict) \
                    and "properties" in branch["items"]:
                out += _fields(branch["items"], dotted + "[].")
    return out


def _place(body: dict, dotted: str, value: Any) -> dict:
    """body with the field at `dotted` set to value, inside the smallest good objects around it."""
    body = copy.deepcopy(body)
    parent, _, key = dotted.rpartition(".")
    if parent and parent not in PARENTS:
        raise KeyError(f"{parent}: say in PARENTS where it sits and what the smallest good one is")
    ancestors = [p for p in PARENTS if parent == p or parent.startswith(p + ".")]
    target: Any = body
    for outer in sorted(ancestors, key=len):
        path, smallest = PARENTS[outer]
        target = body
        for step, after in zip(path, path[1:]):
            if isinstance(step, str) and not isinstance(target.get(step), list if isinstance(after, int) else dict):
                target[step] = [] if isinstance(after, int) else {}
            target = target[step]
        if isinstance(path[-1], int):
            target[:] = [None] * (path[-1] + 1)  # an array of the one object
        target[path[-1]] = copy.deepcopy(AROUND.get(dotted, smallest) if outer == parent else smallest)
        target = target[path[-1]]
    target[key] = value
    return body


def _validation_takes(parse, body: dict) -> bool:
    try:
        parse(body)
    except APIError as exc:
        assert exc.status < 500
        return False
    return True


ENDPOINTS = [
    ("chat", "ChatCompletionRequest", CHAT, lambda b: parse_chat(b, MODEL)),
    ("completions", "CompletionRequest", COMPLETION, lambda b: parse_completion(b, MODEL)),
]


@pytest.mark.parametrize("endpoint, name, base, parse", ENDPOINTS, ids=[e[0] for e in ENDPOINTS])
def test_each_field_takes_what_validation_takes(endpoint, name, base, parse):
    schema, document = SCHEMAS[name], _validator(name)
    disagree = []
    fields = _fields(schema)
    assert len(fields) > 40  # every declared field, nested ones too
    for dotted, sub in fields:
        values = GENERIC + _schema_values(sub) + GOOD.get(dotted, []) + GOOD.get(dotted.rsplit(".", 1)[-1], [])
        beside = BESIDE.get(dotted, {})
        for value in values:
            if dotted in ("max_tokens", "max_completion_tokens") and isinstance(value, int) and value > N_CTX:
                continue  # refused after parsing, with the prompt's length: the two must fit the context
            body = _place(base | beside, dotted, value)
            said, took = document.is_valid(body), _validation_takes(parse, body)
            if said != took and not (said and (endpoint, dotted) in GAPS):
                disagree.append(f"{dotted} = {value!r}: the document {'takes' if said else 'refuses'} it, "
                                f"validation {'takes' if took else 'refuses'} it")
    assert not disagree, "\n".join(disagree)


@pytest.mark.parametrize("endpoint, name, base, parse", ENDPOINTS, ids=[e[0] for e in ENDPOINTS])
def test_the_required_keys_are_what_validation_requires(endpoint, name, base, parse):
    schema = SCHEMAS[name]
    assert set(schema["required"]) == set(base)  # the smallest body is the required keys, and validation takes it
    assert _validation_takes(parse, base) and _validator(name).is_valid(base)
    for key in schema["required"]:
        less = {k: v for k, v in base.items() if k != key}
        assert not _validation_takes(parse, less) and not _validator(name).is_valid(less), key
    for parent, (path, smallest) in PARENTS.items():
        if endpoint != "chat" and not parent.startswith(("stream_options", "syshax", "response_format",
                                                          "structured_outputs")):
            continue
        for key in smallest:  # every key of the smallest good object is one validation needs
            dotted = f"{parent}.{key}"
            body = _place(base | BESIDE.get(parent, {}), dotted, "placeholder")
            at: Any = body
            for step in path:
                at = at[step]
            del at[key]
            said, took = _validator(name).is_valid(body), _validation_takes(parse, body)
            assert said == took, f"{dotted} left out: the document {'takes' if said else 'refuses'} it, " \
                                 f"validation {'takes' if took else 'refuses'} it"


def test_enums_hold_every_value_validation_takes():
    chat = SCHEMAS["ChatCompletionRequest"]["properties"]
    assert chat["messages"]["items"]["properties"]["role"]["enum"] == list(CHAT_ROLES)
    mode = chat["syshax"]["anyOf"][0]["properties"]["mode"]["anyOf"][0]
    assert mode["enum"] == list(MODES)
    for role, mode in itertools.product(CHAT_ROLES, MODES):
        message = {"role": role, "content": "hi"} | ({"tool_call_id": "c"} if role == "tool" else {})
        assert _validation_takes(lambda b: parse_chat(b, MODEL), CHAT | {"messages": [message],
                                                                               "syshax": {"mode": mode}})
