"""Every way a client may constrain the output -> one GBNF grammar, and the field it came from.

Clients come from three servers and bring their fields: OpenAI's `response_format`; vLLM's `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` and their newer form `structured_outputs` {json, regex,
choice, grammar}; llama-server's `grammar` (GBNF), top-level `json_schema`, and `response_format`
{"type": "json_object", "schema": ...}. Each field keeps the meaning of the server its name comes from,
and every one becomes the grammar the engines already enforce (GenerateRequest.grammar). A request may
use one of them: two are a 400, never one silently preferred.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from syshaxd.api.core.errors import invalid
from syshaxd.api.core.structured import SchemaError, json_object_grammar, parse_response_format, schema_error, \
    schema_to_grammar

MAX_GRAMMAR_BYTES = 64 * 1024  # as MAX_SCHEMA_BYTES: a grammar is compiled per request in the worker
MAX_CHOICES = 1024
# {m,n} is unrolled into that many rules (by the regex converter here, by llama.cpp for GBNF): a bound keeps
# one request from filling the worker's memory and time
MAX_REPEAT = 1000
_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
_GBNF_LITERAL = re.compile(r'"(?:\\.|[^"\\])*"')
# vLLM's structured_outputs keys that each give the grammar (one of them)
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class Constraint:
    grammar: str  # GBNF, root rule "root"
    field: str  # the request field it came from: errors about the grammar name it


def parse_constraint(body: dict) -> Constraint | None:
    """The request's output constraint, from whichever field carries it; None when the output is free."""
    found = [name for name in ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                               "structured_outputs", "grammar", "json_schema") if body.get(name) is not None]
    if found and found[0] == "response_format" and _is_text(body["response_format"]):
        found = found[1:]  # {"type": "text"} constrains nothing, and may sit beside another form
    if len(found) > 1:
        raise invalid(f"'{found[0]}' and '{found[1]}' both constrain the output; send one of them.", param=found[1])
    if not found:
        if body.get("response_format") is not None:
            parse_response_format(body["response_format"])  # {"type": "text"}, checked
        return None
    name = found[0]
    value = body[name]
    if name == "response_format":
        return Constraint(_response_format(value), name)
    if name in ("guided_json", "json_schema"):
        return Constraint(_schema(value, name), name)
    if name == "guided_regex":
        return Constraint(regex_grammar(_string(value, name), name), name)
    if name == "guided_choice":
        return Constraint(choice_grammar(value, name), name)
    if name in ("guided_grammar", "grammar"):
        return Constraint(_gbnf(value, name), name)
    return _structured_outputs(value)


def _is_text(fmt: Any) -> bool:
    return isinstance(fmt, dict) and fmt.get("type") == "text"


def _response_format(fmt: Any) -> str:
    """OpenAI's response_format, and llama-server's {"type": "json_object", "schema": {...}} (its schema holds)."""
    if isinstance(fmt, dict) and fmt.get("type") == "json_object" and fmt.get("schema") not in (None, {}):
        return _schema(fmt["schema"], "response_format.schema")
    return parse_response_format(fmt)


def _schema(schema: Any, where: str) -> str:
    if isinstance(schema, str):  # vLLM takes guided_json as JSON text too
        try:
            schema = json.loads(schema)
        except ValueError:
            raise invalid(f"Invalid '{where}': a JSON Schema as an object, or as JSON text; this text is not JSON.",
                          param=where) from None
    if not isinstance(schema, (dict, bool)):
        raise invalid(f"Invalid type for '{where}': expected a JSON Schema (an object).", param=where,
                      code="invalid_type")
    try:
        return schema_to_grammar(schema, where)
    except SchemaError as exc:
        raise schema_error(exc, where) from None


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise invalid(f"Invalid type for '{where}': expected a string.", param=where, code="invalid_type")
    if not value:
        raise invalid(f"Invalid '{where}': it must not be empty.", param=where)
    if len(value.encode()) > MAX_GRAMMAR_BYTES:
        raise invalid(f"Invalid '{where}': longer than {MAX_GRAMMAR_BYTES} bytes.", param=where)
    return value


def _bounded_repeats(text: str, where: str) -> None:
    for m in _REPEAT.finditer(text):
        if any(int(g) > MAX_REPEAT for g in m.groups() if g):
            raise invalid(f"Invalid '{where}': the repetition {m.group(0)} is above {MAX_REPEAT}; a grammar unrolls "
                          "it into that many rules.", param=where)


def _gbnf(value: Any, where: str) -> str:
    """A grammar as the client wrote it: GBNF with a rule named root (llama.cpp's and xgrammar's syntax)."""
    text = _string(value, where)
    _bounded_repeats(_GBNF_LITERAL.sub('""', text), where)
    if not re.search(r"(?m)^\s*root\s*::=", text):
        raise invalid(f"Invalid '{where}': a GBNF grammar needs a rule named root (root ::= ...), where the output "
                      "starts.", param=where)
    return text


def gbnf_literal(text: str) -> str:
    """text as a GBNF string literal."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ch == "\x7f":
            out.append(f"\\x{ord(ch):02X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def choice_grammar(choices: Any, where: str) -> str:
    """vLLM's guided_choice: the output is exactly one of the strings."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise invalid(f"Invalid '{where}': expected a non-empty array of strings.", param=where, code="invalid_type")
    if len(choices) > MAX_CHOICES:
        raise invalid(f"Invalid '{where}': at most {MAX_CHOICES} choices.", param=where)
    if any(c == "" for c in choices):
        raise invalid(f"Invalid '{where}': a choice must not be empty.", param=where)
    return "root ::= " + " | ".join(gbnf_literal(c) for c in dict.fromkeys(choices))


# --- regular expressions (vLLM's guided_regex) -------------------------------------------------------

# Python's re classes, spelled out for GBNF: the converter below does not know \d, \w, \s
_CLASSES = {"d": "0-9", "w": "a-zA-Z0-9_", "s": " \\t\\n\\r\\x0B\\x0C"}


def _escaped(ch: str) -> str:
    """One character inside a GBNF class, escaped where GBNF wants it."""
    if ch in "]\\-^[":
        return f"\\x{ord(ch):02X}"
    return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(ch, ch)


def _plain_regex(pattern: str, where: str) -> str:
    """The pattern with what the GBNF converter cannot read rewritten: \\d \\w \\s (and their negations) as classes,
    escaped punctuation as one-character classes, (?: as (. Lookarounds, backreferences and lazy quantifiers
    cannot be a grammar: refused."""
    out = []
    i, n = 0, len(pattern)
    in_class = False
    while i < n:
        c = pattern[i]
        if c == "\\" and i + 1 < n:
            nxt = pattern[i + 1]
            i += 2
            if nxt.lower() in _CLASSES:
                chars = _CLASSES[nxt.lower()]
                if in_class:
                    if nxt.isupper():
                        raise invalid(f"Invalid '{where}': \\{nxt} inside [...] is not supported.", param=where)
                    out.append(chars)
                else:
                    out.append(("[^" if nxt.isupper() else "[") + chars + "]")
            elif nxt in "ntr":
                out.append("\\" + nxt)
            elif nxt.isdigit() or nxt in "bBAZzpPkg":
                raise invalid(f"Invalid '{where}': \\{nxt} (a backreference, boundary or property) cannot be turned "
                              "into a grammar.", param=where)
            elif nxt.isalnum():
                raise invalid(f"Invalid '{where}': the escape \\{nxt} is not supported.", param=where)
            else:
                out.append(_escaped(nxt) if in_class else "[" + _escaped(nxt) + "]")
            continue
        if in_class:
            if c == "]":
                in_class = False
            out.append(c)
            i += 1
            continue
        if c == "[":
            in_class = True
            out.append(c)
            i += 1
            if i < n and pattern[i] == "^":
                out.append("^")
                i += 1
            if i < n and pattern[i] == "]":  # a ] first in a class is a literal one
                out.append("\\x5D")
                i += 1
            continue
        if c == "(" and pattern.startswith("(?", i):
            if pattern.startswith("(?:", i):
                out.append("(")
                i += 3
                continue
            raise invalid(f"Invalid '{where}': lookarounds and other (?...) groups cannot be turned into a grammar.",
                          param=where)
        if c in "*+?}" and i + 1 < n and pattern[i + 1] in "?+":
            raise invalid(f"Invalid '{where}': lazy and possessive quantifiers ({c}{pattern[i + 1]}) are not "
                          "supported; a grammar matches the same strings without them.", param=where)
        if c in "^$":
            raise invalid(f"Invalid '{where}': anchors (^, $) inside the pattern are not supported; the whole "
                          "output always matches the whole pattern.", param=where)
        out.append(c)
        i += 1
    if in_class:
        raise invalid(f"Invalid '{where}': an unclosed [ class.", param=where)
    return "".join(out)


def regex_grammar(pattern: str, where: str) -> str:
    """vLLM's guided_regex: the whole output matches the pattern (anchors at its ends are allowed)."""
    try:
        re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as exc:
        raise invalid(f"Invalid '{where}': not a regular expression ({exc}).", param=where) from None
    _bounded_repeats(pattern, where)
    body = pattern[1:] if pattern.startswith("^") else pattern
    body = body[:-1] if body.endswith("$") and not body.endswith("\\$") else body
    from llama_cpp.llama_grammar import SchemaConverter

    plain = _plain_regex(body, where)
    converter = SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=True)
    try:
        converter.visit({"type": "string", "pattern": "^" + plain + "$"}, "")
    except Exception as exc:  # noqa: BLE001  (the converter asserts, and fails in its own ways on odd input)
        raise invalid(f"Invalid '{where}': this regular expression cannot be turned into a grammar ({exc}).",
                      param=where) from None
    return converter.format_grammar()


def _structured_outputs(value: Any) -> Constraint:
    """vLLM's structured_outputs: exactly one of json, regex, choice, grammar (json_object: true)."""
    where = "structured_outputs"
    if not isinstance(value, dict):
        raise invalid(f"Invalid type for '{where}': expected an object.", param=where, code="invalid_type")
    kinds = [k for k in STRUCTURED_OUTPUT_KINDS if value.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise invalid(f"Invalid '{where}': give exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)}"
                      + (f"; got {', '.join(kinds)}" if kinds else "") + ".", param=where)
    kind = kinds[0]
    at = f"{where}.{kind}"
    if kind == "json":
        return Constraint(_schema(value[kind], at), at)
    if kind == "regex":
        return Constraint(regex_grammar(_string(value[kind], at), at), at)
    if kind == "choice":
        return Constraint(choice_grammar(value[kind], at), at)
    if kind == "grammar":
        return Constraint(_gbnf(value[kind], at), at)
    if value[kind] is not True:
        raise invalid(f"Invalid type for '{at}': expected true.", param=at, code="invalid_type")
    return Constraint(json_object_grammar(), at)
