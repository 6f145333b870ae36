"""Check OpenAI request bodies field by field and turn them into GenerateRequests."""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass
from typing import Any

from syshaxd.api.errors import APIError, invalid
from syshaxd.config import MODES
from syshaxd.engine.types import GenerateRequest, SamplingParams

MAX_STOP = 4
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # as OpenAI's legacy completions endpoint

# The ranges _common enforces; api/openapi.py documents these same numbers.
NUMBER_RANGES = {
    "temperature": (0.0, 2.0),
    "top_p": (0.0, 1.0),
    "min_p": (0.0, 1.0),
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
    "repetition_penalty": (0.01, 10.0),
}
INTEGER_RANGES = {
    "top_k": (0, 2**31 - 1),  # llama.cpp takes an int32; anything above the vocabulary means "off"
    "seed": (-(2**63), 2**64 - 1),
}
NUMBER_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "min_p": 0.0, "presence_penalty": 0.0,
                   "frequency_penalty": 0.0, "repetition_penalty": 1.0}


@dataclass(frozen=True)
class ParsedRequest:
    generate: GenerateRequest
    stream: bool
    include_usage: bool
    model: str


def parse_json_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except UnicodeDecodeError:
        raise invalid("The request body is not valid UTF-8; send JSON encoded as UTF-8.", code="invalid_json") from None
    except RecursionError:  # json.loads recurses once per nesting level
        raise invalid("The request body nests arrays or objects too deeply; no field of this API needs more "
                      "than a few levels.", code="invalid_json") from None
    except ValueError as exc:
        raise invalid(
            f"We could not parse the JSON body of your request ({exc}). Send a JSON object with "
            "Content-Type: application/json.",
            code="invalid_json",
        ) from None
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.", code="invalid_json")
    return body


def _type_error(name: str, expected: str, value: Any) -> APIError:
    got = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
           dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)
    return invalid(f"Invalid type for '{name}': expected {expected}, but got {got} instead.", param=name,
                   code="invalid_type")


def _text(name: str, value: str) -> str:
    """value, if it can be encoded as UTF-8 (JSON's \\ud800 escapes can make lone surrogates that cannot)."""
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise invalid(f"Invalid '{name}': character {exc.start} is a lone UTF-16 surrogate "
                          f"({value[exc.start]!a}), which is not text; send valid Unicode.", param=name) from None
    return value


def _number(body: dict, name: str, default: float | None, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _type_error(name, "a number", value)
    if not low <= value <= high:
        raise invalid(f"Invalid '{name}': {value} is out of range; it must be between {low} and {high}.", param=name)
    return float(value)


def _integer(body: dict, name: str, default: int | None, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _type_error(name, "an integer", value)
    if value < low or (high is not None and value > high):
        limit = f"at least {low}" if high is None else f"between {low} and {high}"
        raise invalid(f"Invalid '{name}': {value}; it must be {limit}.", param=name)
    return value


def _boolean(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _type_error(name, "a boolean", value)
    return value


def _stop(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise _type_error("stop", "a string or an array of strings", value)
    if len(value) > MAX_STOP:
        raise invalid(f"Invalid 'stop': at most {MAX_STOP} stop sequences are allowed, got {len(value)}.", param="stop")
    if any(s == "" for s in value):
        raise invalid("Invalid 'stop': stop sequences must not be empty strings.", param="stop")
    return tuple(_text("stop", s) for s in value)


def _unsupported(body: dict, name: str, allowed: tuple = (None,), why: str = "") -> None:
    if name in body and body[name] not in allowed:
        raise invalid(f"'{name}' is not supported by this server{': ' + why if why else ''}.", param=name,
                      code="unsupported_parameter")


def _common(body: dict, served_model: str) -> tuple[str, SamplingParams, bool, bool, tuple[str, ...], bool]:
    model = body.get("model")
    if model is None:
        raise invalid("you must provide a model parameter", param="model", code="missing_required_parameter")
    if not isinstance(model, str):
        raise _type_error("model", "a string", model)
    if model != served_model:
        raise APIError(404, f"The model `{model}` does not exist. This server serves `{served_model}`.",
                       param="model", code="model_not_found")
    n = body.get("n")
    if n is not None:
        if isinstance(n, bool) or not isinstance(n, int):
            raise _type_error("n", "an integer", n)
        if n != 1:
            raise invalid(f"Invalid 'n': {n}. This server returns one choice per request; send n=1 "
                          "(or several requests).", param="n", code="unsupported_parameter")
    numbers = {name: _number(body, name, NUMBER_DEFAULTS[name], low, high)
               for name, (low, high) in NUMBER_RANGES.items()}
    sampling = SamplingParams(
        **numbers,
        top_k=_integer(body, "top_k", 0, *INTEGER_RANGES["top_k"]),
        seed=_integer(body, "seed", None, *INTEGER_RANGES["seed"]),
    )
    stream = _boolean(body, "stream", False)
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise _type_error("stream_options", "an object", options)
        if not stream:
            raise invalid("'stream_options' is only allowed when 'stream' is true.", param="stream_options")
        include_usage = _boolean(options, "include_usage", False)
    _unsupported(body, "logit_bias", (None, {}))
    ignore_eos = _boolean(body, "ignore_eos", False)
    return model, sampling, stream, include_usage, _stop(body), ignore_eos


def _route(body: dict) -> str:
    """syshax's own extension: {"syshax": {"mode": "cpu" | "gpu" | "hetero" | "auto"}} routes this request alone
    (the scheduler answers 400 when the daemon does not serve that mode)."""
    ext = body.get("syshax")
    if ext is None:
        return ""
    if not isinstance(ext, dict):
        raise _type_error("syshax", "an object", ext)
    mode = ext.get("mode")
    if mode is None:
        return ""
    if mode not in MODES:
        raise invalid(f"Invalid 'syshax.mode': {mode!r}; it must be one of {', '.join(map(repr, MODES))}.",
                      param="syshax.mode")
    return mode


def _max_tokens(body: dict, names: tuple[str, ...], default: int | None) -> int | None:
    for name in names:
        if body.get(name) is not None:
            return _integer(body, name, default, 1)
    return default


def _prompt(body: dict) -> tuple[str | None, tuple[int, ...] | None]:
    if "prompt" not in body or body["prompt"] is None:
        raise invalid("you must provide a prompt parameter", param="prompt", code="missing_required_parameter")
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        if p == "":
            raise invalid("Invalid 'prompt': the prompt must not be empty.", param="prompt")
        return _text("prompt", p), None
    if isinstance(p, list):
        if not p:
            raise invalid("Invalid 'prompt': the prompt must not be empty.", param="prompt")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            if any(t < 0 for t in p):
                raise invalid("Invalid 'prompt': token ids must not be negative.", param="prompt")
            return None, tuple(p)
        if all(isinstance(t, (str, list)) for t in p):
            raise invalid(f"Invalid 'prompt': this server takes one prompt per request, got {len(p)}; "
                          "send one request per prompt.", param="prompt", code="unsupported_parameter")
    raise _type_error("prompt", "a string, an array of token ids, or an array with one of those", p)


def parse_completion(body: dict, served_model: str, default_max_tokens: int) -> ParsedRequest:
    model, sampling, stream, include_usage, stop, ignore_eos = _common(body, served_model)
    prompt, tokens = _prompt(body)
    _unsupported(body, "echo", (None, False))
    _unsupported(body, "suffix", (None, ""))
    _unsupported(body, "best_of", (None, 1))
    _unsupported(body, "logprobs", (None,), "logprobs are not computed")
    req = GenerateRequest(
        request_id=f"cmpl-{uuid.uuid4().hex}",
        max_tokens=_max_tokens(body, ("max_tokens",), COMPLETIONS_DEFAULT_MAX_TOKENS),
        sampling=sampling,
        prompt=prompt,
        prompt_tokens=tokens,
        stop=stop,
        ignore_eos=ignore_eos,
        default_max_tokens=default_max_tokens,
        route=_route(body),
    )
    return ParsedRequest(req, stream, include_usage, model)


def _message(i: int, m: Any) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise _type_error(where, "an object", m)
    role = m.get("role")
    if role not in CHAT_ROLES:
        raise invalid(f"Invalid '{where}.role': {role!r}; it must be one of {', '.join(CHAT_ROLES)}.",
                      param=f"{where}.role")
    name = m.get("name")  # the template ignores it, but a name must be text, as OpenAI's is
    if name is not None and not isinstance(name, str):
        raise _type_error(f"{where}.name", "a string", name)
    content = m.get("content")
    if content is None and role == "assistant":
        content = ""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid(f"Invalid '{where}.content[{j}]': only text parts are supported "
                              '({"type": "text", "text": ...}).', param=f"{where}.content")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise _type_error(f"{where}.content", "a string or an array of text parts", content)
    return {"role": role, "content": _text(f"{where}.content", content)}


def parse_chat(body: dict, served_model: str, default_max_tokens: int, max_messages: int = 2048) -> ParsedRequest:
    model, sampling, stream, include_usage, stop, ignore_eos = _common(body, served_model)
    messages = body.get("messages")
    if messages is None:
        raise invalid("you must provide a messages parameter", param="messages", code="missing_required_parameter")
    if not isinstance(messages, list):
        raise _type_error("messages", "an array", messages)
    if not messages:
        raise invalid("Invalid 'messages': empty array. Expected an array with at least one message.",
                      param="messages", code="empty_array")
    if len(messages) > max_messages:
        raise invalid(f"Invalid 'messages': array too long. Expected an array with maximum length {max_messages}, "
                      f"but got an array with length {len(messages)} instead (max_messages).", param="messages",
                      code="array_above_max_length")
    parsed = tuple(_message(i, m) for i, m in enumerate(messages))
    _unsupported(body, "logprobs", (None, False), "logprobs are not computed")
    _unsupported(body, "top_logprobs", (None,), "logprobs are not computed")
    _unsupported(body, "tools", (None, []), "tool calling is not implemented")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise invalid("'response_format' other than {\"type\": \"text\"} is not supported by this server.",
                      param="response_format", code="unsupported_parameter")
    req = GenerateRequest(
        request_id=f"chatcmpl-{uuid.uuid4().hex}",
        max_tokens=_max_tokens(body, ("max_completion_tokens", "max_tokens"), None),
        sampling=sampling,
        messages=parsed,
        stop=stop,
        ignore_eos=ignore_eos,
        default_max_tokens=default_max_tokens,
        route=_route(body),
    )
    return ParsedRequest(req, stream, include_usage, model)
