"""response_format and tool schemas -> a GBNF grammar that constrains sampling (llama.cpp's grammar sampler).

The conversion is llama-cpp-python's json_schema_to_gbnf. That converter silently drops the JSON
Schema keywords it does not understand (minimum, not, if/then, ...), which would give output that
parses but need not validate; so every schema is first walked here, and a keyword outside the
supported set is a 400 that names it and where it is. The daemon converts, so an unsupported schema
is refused before any engine work, and the worker only ever sees grammar text.
"""

from __future__ import annotations

import json
import re

from syshaxd.api.core.errors import invalid
from syshaxd.api.core.fields import NAME_PATTERN

# Keywords that only describe: they never change which instances validate.
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id", "$comment",
                          "deprecated", "readOnly", "writeOnly"})
_TYPES = frozenset({"string", "number", "integer", "boolean", "null", "object", "array"})
# format values the converter turns into rules; any other format would be ignored, so it is refused
_FORMATS = frozenset({"date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5"})
_SUPPORTED = frozenset({"type", "properties", "required", "additionalProperties", "items", "prefixItems",
                        "minItems", "maxItems", "enum", "const", "anyOf", "$ref", "$defs", "definitions",
                        "minLength", "maxLength", "format", "pattern"}) | _ANNOTATIONS
MAX_SCHEMA_BYTES = 64 * 1024  # a grammar is rebuilt per request in the worker; no real schema is larger
MAX_DEPTH = 16

# JSON strings may not hold raw control characters; the converter's `char` rule allows them
# (json.loads would then refuse the output), so the rule is narrowed to what JSON allows.
_CHAR_RULE = re.compile(r"^char ::= .*$", re.M)
_JSON_CHAR = r'char ::= [^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4})'


class SchemaError(ValueError):
    """A schema this server cannot turn into a grammar; `where` is the JSON path of the offending part."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(message)
        self.where = where


def _check(schema, where: str, depth: int = 0) -> None:
    """Raise SchemaError at the first construct the converter would not honour."""
    if isinstance(schema, bool):
        if schema:
            return  # `true`: anything
        raise SchemaError(where, "the schema `false` matches nothing")
    if not isinstance(schema, dict):
        raise SchemaError(where, "a schema must be an object")
    if depth > MAX_DEPTH:
        raise SchemaError(where, f"the schema nests deeper than {MAX_DEPTH} levels")
    for key in schema:
        if key not in _SUPPORTED:
            hint = " (use anyOf)" if key == "oneOf" else ""
            raise SchemaError(f"{where}.{key}", f"the JSON Schema keyword '{key}' is not supported{hint}")
    t = schema.get("type")
    types = t if isinstance(t, list) else [t] if t is not None else []
    if not all(isinstance(x, str) and x in _TYPES for x in types):
        raise SchemaError(f"{where}.type", f"'type' must be one of {', '.join(sorted(_TYPES))}, or a list of them")
    if isinstance(t, list) and len(schema.keys() - _ANNOTATIONS - {"type"}) > 0:
        raise SchemaError(f"{where}.type", "a list of types with other keywords beside it is not supported "
                                           "(use anyOf of one schema per type)")
    if "format" in schema and schema["format"] not in _FORMATS:
        raise SchemaError(f"{where}.format", f"the string format {schema['format']!r} is not supported "
                                             f"(supported: {', '.join(sorted(_FORMATS))})")
    pattern = schema.get("pattern")
    if pattern is not None and not (isinstance(pattern, str) and pattern.startswith("^") and pattern.endswith("$")):
        raise SchemaError(f"{where}.pattern", "a 'pattern' must be anchored: start with ^ and end with $")
    if "$ref" in schema:
        ref = schema["$ref"]
        if not isinstance(ref, str) or not ref.startswith(("#/$defs/", "#/definitions/")):
            raise SchemaError(f"{where}.$ref", "only local references (#/$defs/... or #/definitions/...) are supported")
        if len(schema.keys() - _ANNOTATIONS - {"$ref"}) > 0:
            raise SchemaError(f"{where}.$ref", "keywords beside '$ref' are not supported")
    for key in ("minItems", "maxItems", "minLength", "maxLength"):
        if key in schema and (isinstance(schema[key], bool) or not isinstance(schema[key], int) or schema[key] < 0):
            raise SchemaError(f"{where}.{key}", f"'{key}' must be a non-negative integer")
    for key in ("enum", "anyOf", "required", "prefixItems"):
        if key in schema and (not isinstance(schema[key], list) or not schema[key]):
            raise SchemaError(f"{where}.{key}", f"'{key}' must be a non-empty array")
    if "required" in schema:
        if not all(isinstance(r, str) for r in schema["required"]):
            raise SchemaError(f"{where}.required", "'required' must list property names")
        missing = [r for r in schema["required"] if r not in schema.get("properties", {})]
        if missing:  # the converter can only write properties it has a schema for
            raise SchemaError(f"{where}.required", f"required property {missing[0]!r} is not in 'properties'")
    for key in ("properties", "$defs", "definitions"):
        if key in schema:
            if not isinstance(schema[key], dict):
                raise SchemaError(f"{where}.{key}", f"'{key}' must be an object")
            for name, sub in schema[key].items():
                _check(sub, f"{where}.{key}.{name}", depth + 1)
    for key in ("items", "additionalProperties"):
        if key in schema and schema[key] is not False:
            _check(schema[key], f"{where}.{key}", depth + 1)
    for key in ("anyOf", "prefixItems"):
        for i, sub in enumerate(schema.get(key, ())):
            _check(sub, f"{where}.{key}[{i}]", depth + 1)


def _bool_schemas(schema):
    """The schema with `true` subschemas as {} (the converter reads only objects); `false` was refused."""
    if schema is True:
        return {}
    if isinstance(schema, dict):
        return {k: (_bool_schemas(v) if k not in ("enum", "const", "default", "examples", "required") else v)
                for k, v in schema.items()}
    if isinstance(schema, list):
        return [_bool_schemas(x) for x in schema]
    return schema


def schema_to_grammar(schema, where: str) -> str:
    """GBNF for `schema`; SchemaError naming the unsupported construct."""
    _check(schema, where)
    text = json.dumps(_bool_schemas(schema))
    if len(text) > MAX_SCHEMA_BYTES:
        raise SchemaError(where, f"the schema is larger than {MAX_SCHEMA_BYTES} bytes")
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    try:
        gbnf = json_schema_to_gbnf(text)
    except Exception as exc:  # noqa: BLE001  (the converter asserts, and fails in its own ways on odd input)
        raise SchemaError(where, f"the schema could not be turned into a grammar ({exc})") from None
    return _CHAR_RULE.sub(lambda _: _JSON_CHAR, gbnf)


def json_object_grammar() -> str:
    """Any JSON object (response_format json_object)."""
    return schema_to_grammar({"type": "object"}, "response_format")


def schema_error(exc: SchemaError, param: str):
    return invalid(f"Invalid '{exc.where}': {exc}. This server constrains output with a grammar built from the "
                   "schema and refuses what it cannot enforce.", param=param, code="unsupported_schema")


def parse_response_format(fmt) -> str:
    """The grammar for a chat request's response_format; "" for plain text."""
    if fmt is None:
        return ""
    if not isinstance(fmt, dict):
        raise invalid("Invalid type for 'response_format': expected an object.", param="response_format",
                      code="invalid_type")
    kind = fmt.get("type")
    if kind == "text":
        return ""
    if kind == "json_object":
        return json_object_grammar()
    if kind != "json_schema":
        raise invalid(f"Invalid 'response_format.type': {kind!r}; it must be one of 'text', 'json_object', "
                      "'json_schema'.", param="response_format.type")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise invalid("Missing required parameter: 'response_format.json_schema' (an object with 'name' and "
                      "'schema').", param="response_format.json_schema", code="missing_required_parameter")
    name = spec.get("name")
    if not isinstance(name, str) or not re.fullmatch(NAME_PATTERN, name):
        raise invalid("Invalid 'response_format.json_schema.name': it must be 1 to 64 of a-z, A-Z, 0-9, _ and -.",
                      param="response_format.json_schema.name")
    if spec.get("description") is not None and not isinstance(spec["description"], str):
        raise invalid("Invalid type for 'response_format.json_schema.description': expected a string.",
                      param="response_format.json_schema.description", code="invalid_type")
    if "strict" in spec and spec["strict"] is not None and not isinstance(spec["strict"], bool):
        raise invalid("Invalid type for 'response_format.json_schema.strict': expected a boolean.",
                      param="response_format.json_schema.strict", code="invalid_type")
    schema = spec.get("schema", {})  # OpenAI: no schema means any JSON (strict or not, output is enforced here)
    try:
        return schema_to_grammar(schema, "response_format.json_schema.schema")
    except SchemaError as exc:
        raise schema_error(exc, "response_format.json_schema.schema") from None
