"""Check chat and completions bodies field by field, within the limits api/core/fields.py declares, and turn them into
ParsedRequests: one GenerateRequest per choice, and how to show the results."""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass, replace
from typing import Any, overload

from syshaxd.api.core import fields
from syshaxd.api.core.constraints import Constraint, parse_constraint
from syshaxd.api.core.errors import APIError, invalid, one_of
from syshaxd.api.core.fields import (CHAT_ROLES, INTEGER_RANGES, MAX_LOGPROBS, MAX_N, MAX_PROMPTS, MAX_STOP,
                                     NUMBER_RANGES, check_fields)
from syshaxd.api.core.reasoning import Thinking, parse_thinking
from syshaxd.api.core.tools import Tools, call_grammar, parse_tools
from syshaxd.config import MODES
from syshaxd.sdk.types import GenerateRequest, SamplingParams

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # as OpenAI's legacy completions endpoint

NUMBER_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "min_p": 0.0, "presence_penalty": 0.0,
                   "frequency_penalty": 0.0, "repetition_penalty": 1.0}


@dataclass(frozen=True)
class ParsedRequest:
    """One API request: one GenerateRequest per choice (prompt_index * n + j), and how to show the results."""

    generates: tuple[GenerateRequest, ...]
    stream: bool
    include_usage: bool
    model: str
    n: int = 1
    echo: bool = False  # completions: each choice's text begins with its prompt
    prompts: tuple[str | None, ...] = (None,)  # each prompt's text; None: token ids (echo detokenizes them)
    logprobs: bool = False  # completions' `logprobs` or chat's `logprobs: true`
    max_tokens_zero: bool = False  # echo with max_tokens 0: the engines generate one token, which is dropped
    tools: Tools | None = None  # chat with tools: how the output is read back into tool calls
    route: str = ""  # syshax.mode: a mode for this request alone ("auto" lets the decider choose); "": the daemon's
    # the request's fields as routing rules read them (api/core/generation.rule_fields), taken before its prompt
    # is rendered
    fields: dict | None = None
    thinking: Thinking | None = None  # chat: how a reasoning model's output is read (api/core/reasoning.py)

    @property
    def generate(self) -> GenerateRequest:
        return self.generates[0]

    def prompt_index(self, choice: int) -> int:
        return choice // self.n


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


def type_error(name: str, expected: str, value: Any) -> APIError:
    got = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
           dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)
    return invalid(f"Invalid type for '{name}': expected {expected}, but got {got} instead.", param=name,
                   code="invalid_type")


def valid_text(name: str, value: str) -> str:
    """value, if it can be encoded as UTF-8 (JSON's \\ud800 escapes can make lone surrogates that cannot)."""
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise invalid(f"Invalid '{name}': character {exc.start} is a lone UTF-16 surrogate "
                          f"({value[exc.start]!a}), which is not text; send valid Unicode.", param=name) from None
    return value


@overload
def _number(body: dict, name: str, default: float, low: float, high: float) -> float: ...
@overload
def _number(body: dict, name: str, default: None, low: float, high: float) -> float | None: ...
def _number(body: dict, name: str, default: float | None, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise type_error(name, "a number", value)
    if not low <= value <= high:
        raise invalid(f"Invalid '{name}': {value} is out of range; it must be between {low} and {high}.", param=name)
    return float(value)


@overload
def _integer(body: dict, name: str, default: int, low: int, high: int | None = None) -> int: ...
@overload
def _integer(body: dict, name: str, default: None, low: int, high: int | None = None) -> int | None: ...
def _integer(body: dict, name: str, default: int | None, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise type_error(name, "an integer", value)
    if value < low or (high is not None and value > high):
        limit = f"at least {low}" if high is None else f"between {low} and {high}"
        raise invalid(f"Invalid '{name}': {value}; it must be {limit}.", param=name)
    return value


def _boolean(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise type_error(name, "a boolean", value)
    return value


def _stop(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise type_error("stop", "a string or an array of strings", value)
    if len(value) > MAX_STOP:
        raise invalid(f"Invalid 'stop': at most {MAX_STOP} stop sequences are allowed, got {len(value)}.", param="stop")
    if any(s == "" for s in value):
        raise invalid("Invalid 'stop': stop sequences must not be empty strings.", param="stop")
    return tuple(valid_text("stop", s) for s in value)


def _common(body: dict, served_model: str) -> tuple[str, SamplingParams, bool, bool, tuple[str, ...], bool, int]:
    model = body.get("model")
    if model is None:
        raise invalid("you must provide a model parameter", param="model", code="missing_required_parameter")
    if not isinstance(model, str):
        raise type_error("model", "a string", model)
    if model != served_model:
        raise APIError(404, f"The model `{model}` does not exist. This server serves `{served_model}`.",
                       param="model", code="model_not_found")
    n = _integer(body, "n", 1, 1, MAX_N)
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
            raise type_error("stream_options", "an object", options)
        if not stream:
            raise invalid("'stream_options' is only allowed when 'stream' is true.", param="stream_options")
        include_usage = _boolean(options, "include_usage", False)
    ignore_eos = _boolean(body, "ignore_eos", False)
    stop = _stop(body)
    _min_tokens(body, ignore_eos, stop)
    return model, sampling, stream, include_usage, stop, ignore_eos, n


def _min_tokens(body: dict, ignore_eos: bool, stop: tuple[str, ...]) -> None:
    """vLLM's min_tokens (benchmark clients send it beside ignore_eos): taken where it holds anyway -- with
    ignore_eos and no stop string every answer runs to max_tokens, which it may not exceed."""
    n = _integer(body, "min_tokens", 0, 0)
    if not n:
        return
    if not ignore_eos or stop:
        raise invalid("'min_tokens' is supported only with 'ignore_eos': true and no 'stop' (then the answer runs to "
                      "max_tokens); this server does not hold back the end of text for a number of tokens.",
                      param="min_tokens", code="unsupported_parameter")
    for name in ("max_completion_tokens", "max_tokens"):
        limit = body.get(name)
        if isinstance(limit, int) and not isinstance(limit, bool) and n > limit:
            raise invalid(f"Invalid 'min_tokens': {n} is more than {name} ({limit}).", param="min_tokens")


def _route(body: dict) -> str:
    """syshax's own extension: {"syshax": {"mode": "cpu" | "gpu" | "hetero" | "auto"}} routes this request alone
    (the scheduler answers 400 when the daemon does not serve that mode)."""
    ext = body.get("syshax")
    if ext is None:
        return ""
    if not isinstance(ext, dict):
        raise type_error("syshax", "an object", ext)
    mode = ext.get("mode")
    if mode is None:
        return ""
    return one_of(mode, MODES, "syshax.mode")


def _max_tokens(body: dict, names: tuple[str, ...], default: int | None, low: int = 1) -> int | None:
    for name in names:
        if body.get(name) is not None:
            return _integer(body, name, default, low)
    return default


def _one_prompt(p: Any) -> tuple[str | None, tuple[int, ...] | None] | None:
    """(text, None) or (None, token ids) for one prompt; None when p is neither shape."""
    if isinstance(p, str):
        if p == "":
            raise invalid("Invalid 'prompt': the prompt must not be empty.", param="prompt")
        return valid_text("prompt", p), None
    if isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        if not p:
            raise invalid("Invalid 'prompt': the prompt must not be empty.", param="prompt")
        if any(t < 0 for t in p):
            raise invalid("Invalid 'prompt': token ids must not be negative.", param="prompt")
        if any(t >= 2**31 for t in p):  # llama.cpp's token ids are int32 (the prefix cache packs them so too)
            raise invalid("Invalid 'prompt': a token id must be below 2^31; the model's vocabulary is far smaller.",
                          param="prompt")
        return None, tuple(p)
    return None


def _prompts(body: dict) -> list[tuple[str | None, tuple[int, ...] | None]]:
    """The request's prompts: a string or token ids, or an array of those (a batch)."""
    if "prompt" not in body or body["prompt"] is None:
        raise invalid("you must provide a prompt parameter", param="prompt", code="missing_required_parameter")
    p = body["prompt"]
    one = _one_prompt(p)
    if one is not None:
        return [one]
    if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        if len(p) > MAX_PROMPTS:
            raise invalid(f"Invalid 'prompt': at most {MAX_PROMPTS} prompts per request, got {len(p)}.",
                          param="prompt", code="array_above_max_length")
        batch = [b for x in p if (b := _one_prompt(x)) is not None]
        if len(batch) == len(p):
            return batch
    raise type_error("prompt", "a string, an array of token ids, or an array of those", p)


def _choices(base: GenerateRequest, n: int) -> list[GenerateRequest]:
    """n copies of base (one prompt's choices), with seeds seed + j when a seed is given."""
    out = []
    for j in range(n):
        seed = base.sampling.seed
        if seed is not None:
            seed = (seed + j) % 2**64 if seed >= 0 else seed + j
        out.append(replace(base, sampling=replace(base.sampling, seed=seed)))
    return out


def _logprobs_k(body: dict, name: str) -> int | None:
    return _integer(body, name, None, 0, MAX_LOGPROBS)


def parse_completion(body: dict, served_model: str) -> ParsedRequest:
    check_fields(body, fields.COMPLETIONS)
    model, sampling, stream, include_usage, stop, ignore_eos, n = _common(body, served_model)
    prompts = _prompts(body)
    echo = _boolean(body, "echo", False)
    best_of = _integer(body, "best_of", None, 1, MAX_N)
    if best_of is not None and best_of != n:
        raise invalid(f"'best_of' other than n is not supported by this server (got {best_of!r}); send n alone.",
                      param="best_of", code="unsupported_parameter")
    k = _logprobs_k(body, "logprobs")
    # echo with max_tokens 0 returns the prompt alone (lm-eval's loglikelihood asks exactly that)
    max_tokens = _max_tokens(body, ("max_tokens",), COMPLETIONS_DEFAULT_MAX_TOKENS, 0 if echo else 1)
    rid = f"cmpl-{uuid.uuid4().hex}"
    base = GenerateRequest(
        request_id=rid,
        max_tokens=max_tokens or 1,
        sampling=sampling,
        stop=stop,
        ignore_eos=ignore_eos,
        cache_prompt=_boolean(body, "cache_prompt", True),  # llama-server's opt-out of the prefix cache
        logprobs=k,
        prompt_logprobs=k if echo else None,
    )
    constraint = parse_constraint(body)  # vLLM's and llama-server's forms hold for completions too
    if constraint is not None:
        base = replace(base, grammar=constraint.grammar, grammar_field=constraint.field)
    generates = [replace(c, prompt=text, prompt_tokens=tokens) for text, tokens in prompts for c in _choices(base, n)]
    if len(generates) > 1:
        generates = [replace(g, request_id=f"{rid}-{i}") for i, g in enumerate(generates)]
    return ParsedRequest(tuple(generates), stream, include_usage, model, n=n, echo=echo,
                         prompts=tuple(text for text, _ in prompts), logprobs=k is not None,
                         max_tokens_zero=max_tokens == 0, route=_route(body))


def parse_message(i: int, m: Any) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise type_error(where, "an object", m)
    role = m.get("role")
    if role not in CHAT_ROLES:
        raise invalid(f"Invalid '{where}.role': {role!r}; it must be one of {', '.join(CHAT_ROLES)}.",
                      param=f"{where}.role")
    name = m.get("name")  # the template ignores it, but a name must be text, as OpenAI's is
    if name is not None and not isinstance(name, str):
        raise type_error(f"{where}.name", "a string", name)
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
        raise type_error(f"{where}.content", "a string or an array of text parts", content)
    out = {"role": role, "content": valid_text(f"{where}.content", content)}
    if role == "assistant" and m.get("tool_calls") is not None:
        calls = _tool_calls(where, m["tool_calls"])
        if calls:
            out["tool_calls"] = calls
    reasoning = _reasoning(where, m)
    if reasoning is not None:
        out["reasoning_content"] = reasoning
    call_id = m.get("tool_call_id")
    if call_id is not None and not isinstance(call_id, str):
        raise type_error(f"{where}.tool_call_id", "a string", call_id)
    if role == "tool":
        if call_id is None:
            raise invalid(f"Missing required parameter: '{where}.tool_call_id'.", param=f"{where}.tool_call_id",
                          code="missing_required_parameter")
        out["tool_call_id"] = call_id
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    return out


def _reasoning(where: str, m: dict) -> str | None:
    """An assistant message's thinking sent back (as a chat answer gives it: `reasoning_content`, llama-server's and
    DeepSeek's name, or `reasoning`, vLLM's newer one), for templates that render it (Qwen3's, in the turns after the
    last user message)."""
    names = [name for name in ("reasoning_content", "reasoning") if m.get(name) is not None]
    if not names:
        return None
    if m.get("role") != "assistant":
        raise invalid(f"Invalid '{where}.{names[0]}': only an assistant message carries its thinking.",
                      param=f"{where}.{names[0]}")
    for name in names:
        if not isinstance(m[name], str):
            raise type_error(f"{where}.{name}", "a string", m[name])
    texts = {valid_text(f"{where}.{name}", m[name]) for name in names}
    if len(texts) > 1:
        raise invalid(f"Invalid '{where}.reasoning': it differs from '{where}.reasoning_content'; send the thinking "
                      "once (either name).", param=f"{where}.reasoning")
    return texts.pop()


def _tool_calls(where: str, calls: Any) -> list[dict]:
    """An assistant message's earlier tool calls, in OpenAI's shape (arguments as JSON text)."""
    if not isinstance(calls, list):
        raise type_error(f"{where}.tool_calls", "an array", calls)
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or call.get("type") not in (None, "function") or not isinstance(call.get("id"), str) \
                or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise invalid(f"Invalid '{at}': expected {{\"id\": ..., \"type\": \"function\", \"function\": "
                          "{\"name\": ..., \"arguments\": <JSON text>}}.", param=at)
        out.append({"id": call["id"], "type": "function",
                    "function": {"name": valid_text(f"{at}.function.name", fn["name"]),
                                 "arguments": valid_text(f"{at}.function.arguments", fn["arguments"])}})
    return out


def parse_chat(body: dict, served_model: str, max_messages: int = 2048) -> ParsedRequest:
    check_fields(body, fields.CHAT)
    model, sampling, stream, include_usage, stop, ignore_eos, n = _common(body, served_model)
    messages = body.get("messages")
    if messages is None:
        raise invalid("you must provide a messages parameter", param="messages", code="missing_required_parameter")
    if not isinstance(messages, list):
        raise type_error("messages", "an array", messages)
    if not messages:
        raise invalid("Invalid 'messages': empty array. Expected an array with at least one message.",
                      param="messages", code="empty_array")
    if len(messages) > max_messages:
        raise invalid(f"Invalid 'messages': array too long. Expected an array with maximum length {max_messages}, "
                      f"but got an array with length {len(messages)} instead (max_messages).", param="messages",
                      code="array_above_max_length")
    parsed = tuple(parse_message(i, m) for i, m in enumerate(messages))
    logprobs = _boolean(body, "logprobs", False)
    top = _logprobs_k(body, "top_logprobs")
    if top is not None and not logprobs:
        raise invalid("'top_logprobs' needs 'logprobs': true.", param="top_logprobs")
    tools = parse_tools(body)
    constraint = parse_constraint(body)
    if tools is not None and tools.forced:
        if constraint is not None:
            raise invalid(f"'{constraint.field}' cannot be combined with a forced tool call (tool_choice 'required' "
                          "or a named function): the call's arguments follow its schema.", param=constraint.field)
        constraint = Constraint(call_grammar(tools), "tool_choice")
    thinking, template_kwargs = parse_thinking(body)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    req = GenerateRequest(
        request_id=rid,
        max_tokens=_max_tokens(body, ("max_completion_tokens", "max_tokens"), None),
        sampling=sampling,
        messages=parsed,
        stop=stop,
        ignore_eos=ignore_eos,
        cache_prompt=_boolean(body, "cache_prompt", True),  # llama-server's opt-out of the prefix cache
        logprobs=(top or 0) if logprobs else None,
        grammar=constraint.grammar if constraint else "",
        grammar_field=constraint.field if constraint else "response_format",
        tools=tools.tools if tools else (),
        chat_template_kwargs=template_kwargs or None,
    )
    generates = _choices(req, n)
    if n > 1:
        generates = [replace(g, request_id=f"{rid}-{i}") for i, g in enumerate(generates)]
    return ParsedRequest(tuple(generates), stream, include_usage, model, n=n, logprobs=logprobs, tools=tools,
                         route=_route(body), thinking=thinking)
