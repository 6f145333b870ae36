"""The request fields each endpoint reads, declared once; any other field is a 400 that names it.

The policy (OpenAI's own): a field this server does not read is refused, at any depth, rather than
ignored, because an ignored field is often a constraint the client relies on (a schema, a grammar, a
sampling rule) and the answer would break it without a word. Three kinds of field are taken:

* the fields validate.py reads (OpenAI's, and the vLLM and llama-server extensions this server keeps);
* HARMLESS: fields common clients send that change nothing an answer here could show (`user`,
  `metadata`, `store`, ...): accepted and not used;
* DEFAULT_ONLY: the peers' switches, taken only at the value that asks for what this server does anyway
  (vLLM's `use_beam_search: false`, `skip_special_tokens: true`, ...); any other value is a 400.

This module checks names; validate.py checks values, with the limits declared here, and api/openapi.py
writes chat's and completions' request schemas from these declarations (each value's type, enum and range,
each object's required keys); tests/api/test_request_schemas.py holds the two to what validation does.
docs/api.md lists all three kinds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from syshaxd.api.core.errors import invalid
from syshaxd.api.core.reasoning import EFFORTS, ReasoningFormat
from syshaxd.sdk.gguf.chat import RENDER_NAMES

# --- the limits validate.py enforces (the OpenAPI document gives these same numbers) -----------------------

MAX_STOP = 4
MAX_N = 16  # choices per prompt (n)
MAX_PROMPTS = 64  # prompts in one completions request
MAX_LOGPROBS = 20  # top alternatives per token (completions' logprobs, chat's top_logprobs), as vLLM
MAX_TOOLS = 128  # as OpenAI's
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
NAME_PATTERN = "^[a-zA-Z0-9_-]{1,64}$"  # a function's and a response_format schema's name, as OpenAI's
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


# --- how a field is declared ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Val:
    """A value validate.py checks whole (a scalar, a list of strings, a JSON Schema): its JSON Schema as the
    OpenAPI document gives it. `fill` names what the running daemon puts in: "model" (the served model's id as
    the one enum value), "n_ctx" (the context size as the maximum), "routes" (the modes it serves as the enum)."""

    schema: dict = field(default_factory=dict)
    nullable: bool = True  # null is taken as an absent field (validate.py)
    fill: str = ""


@dataclass(frozen=True)
class Obj:
    """An object's known keys, each with the spec of its value (None: a value whose keys are not checked and
    whose type the document leaves open); `doc`: more of its JSON Schema (a description, bounds)."""

    keys: dict[str, "Spec"] = field(default_factory=dict)
    required: tuple[str, ...] = ()
    doc: dict = field(default_factory=dict)
    nullable: bool = True


@dataclass(frozen=True)
class Each:
    """An array whose object items follow `item`."""

    item: "Spec"
    doc: dict = field(default_factory=dict)
    nullable: bool = True


@dataclass(frozen=True)
class OneOf:
    """A value that is `alt` (a string, as the JSON Schema says) or follows `obj` (tool_choice, a message's
    content as parts)."""

    obj: "Obj | Each"
    alt: dict = field(default_factory=dict)
    doc: dict = field(default_factory=dict)
    nullable: bool = True


@dataclass(frozen=True)
class Tagged:
    """An object whose keys depend on the value of its `tag` key (a Responses input item, a Messages content
    block); `untagged` is the kind of one without the tag. An unknown kind is the endpoint's to refuse, by its
    type."""

    kinds: dict[str, Obj]
    tag: str = "type"
    untagged: str | None = None


Spec = Val | Obj | Each | OneOf | Tagged | None

BOOLEAN = Val({"type": "boolean"})
STRING = Val({"type": "string"}, nullable=False)


def _described(schema: dict, description: str) -> Val:
    return Val(schema | {"description": description})


# Accepted at the top level of every endpoint, and not used: nothing in an answer here depends on them.
HARMLESS = {
    "user": "an end-user id for the provider's abuse monitoring",
    "safety_identifier": "the newer name of user",
    "metadata": "tags for the provider's stored completions",
    "store": "whether the provider stores the completion; nothing is stored here",
    "service_tier": "the provider's processing tier; there is one here",
    "prompt_cache_key": "a hint for the provider's prompt cache; the prefix cache here needs none",
    "verbosity": "for reasoning models",
    "guided_decoding_backend": "vLLM's choice of grammar library; one grammar path serves all here",
    "cache_control": "Anthropic's prompt-cache marks (here and on content blocks); the prefix cache needs none",
}

# Taken only at these values (what this server does anyway); None, as everywhere, is absent.
DEFAULT_ONLY: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (False,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "include_stop_str_in_output": (False,),
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
    "echo": (False,),  # vLLM chat's: the last message before the answer
    "stop_token_ids": ([],),
    "modalities": (["text"],),
    "logit_bias": ({},),
    "suffix": ("",),  # completions' text after the insertion point
    "length_penalty": (1, 1.0),
}

# --- chat completions and completions ----------------------------------------------------------------------

_SCHEMA = Val({"type": ["object", "boolean"], "description": "A JSON Schema; keywords the grammar cannot enforce (minimum, not, "
                                                "oneOf, ...) are a 400 naming them."}, nullable=False)
_REGEX = {"type": "string", "minLength": 1, "description": "The whole output matches this regular expression "
          "(no lookarounds, backreferences or lazy quantifiers)."}
_CHOICE = {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1,
           "description": "The output is exactly one of these strings."}
_GBNF = {"type": "string", "minLength": 1, "description": "A GBNF grammar with a rule named root."}


def _vllm(schema: dict, whose: str = "vLLM's") -> Val:
    return _described(schema, f"{whose}: {schema['description']}")


_FUNCTION = Obj({"name": Val({"type": "string", "pattern": NAME_PATTERN}, nullable=False),
                 "description": Val({"type": "string"}),
                 "parameters": Val({"type": "object", "description": "A JSON Schema of the arguments (the same "
                                                                     "keywords as response_format's)."}),
                 "strict": BOOLEAN}, required=("name",), nullable=False)
_TOOL = Obj({"type": Val({"const": "function"}, nullable=False), "function": _FUNCTION}, required=("type", "function"),
            nullable=False)
_TOOL_CALL = Obj({"id": STRING, "type": Val({"const": "function"}),
                  "function": Obj({"name": STRING, "arguments": STRING}, required=("name", "arguments"),
                                  nullable=False),
                  "index": None},  # an answer's own, sent back
                 required=("id", "function"), nullable=False)
# the other part types' keys are known, so that validate.py refuses such a part for what it is (not text)
_TEXT_PART = Obj({"type": Val({"type": "string", "enum": ["text"]}, nullable=False), "text": STRING,
                  "image_url": None, "input_audio": None, "file": None}, required=("type", "text"), nullable=False)
_THOUGHT = _described({"type": "string"}, "An assistant message's thinking, sent back (an answer's "
                                          "`reasoning_content`); templates that render it (Qwen3's) get it.")
_MESSAGE = Obj({
    "role": Val({"type": "string", "enum": list(CHAT_ROLES)}, nullable=False),
    "content": OneOf(Each(_TEXT_PART, nullable=False), alt={"type": "string"},
                     doc={"description": "Text, or text parts; required but in an assistant message, which may send "
                                         "null or none."}),
    "name": Val({"type": "string"}),
    "tool_calls": Each(_TOOL_CALL, {"description": "An assistant message's earlier calls (OpenAI's shape)."}),
    "tool_call_id": Val({"type": "string", "description": "Required in a `tool` message: the call it answers."}),
    "refusal": None, "annotations": None,  # an answer's own, sent back
    "reasoning_content": _THOUGHT, "reasoning": _THOUGHT,  # an answer's thinking, sent back (validate.py)
}, required=("role",), nullable=False)
_RESPONSE_FORMAT = Obj({
    "type": Val({"type": "string", "enum": ["text", "json_object", "json_schema"]}, nullable=False),
    "schema": Val(_SCHEMA.schema | {"description": "llama-server's: with json_object, the output validates "
                                                   "against this JSON Schema."}),
    "json_schema": Obj({"name": Val({"type": "string", "pattern": NAME_PATTERN}, nullable=False),
                        "description": Val({"type": "string"}), "schema": _SCHEMA,
                        "strict": BOOLEAN}, required=("name",), nullable=False,
                       doc={"description": "Required with type json_schema."}),
}, required=("type",), doc={"description": "json_object and json_schema constrain sampling with a grammar: the "
                                           "output parses (and validates).",
                             "if": {"properties": {"type": {"const": "json_schema"}}},
                             "then": {"required": ["type", "json_schema"]}})
_STRUCTURED_OUTPUTS = Obj({"json": _SCHEMA, "regex": Val(_REGEX, nullable=False),
                           "choice": Val(_CHOICE, nullable=False), "grammar": Val(_GBNF, nullable=False),
                           "json_object": Val({"const": True}, nullable=False)},
                          doc={"minProperties": 1, "maxProperties": 1, "description": "vLLM's newer form: exactly "
                               "one of json, regex, choice, grammar, json_object."})


def _max_tokens(default: str, low: int = 1) -> Val:
    return Val({"type": "integer", "minimum": low,
                "description": f"Tokens to generate (default {default}); the prompt plus this must fit the context, "
                               "else 400 `context_length_exceeded`."}, fill="n_ctx")


# Read by both endpoints (validate.py's _common and what follows it)
_COMMON: dict[str, Spec] = {
    "model": Val({"type": "string", "description": "The id /v1/models lists; any other gets 404 "
                                                   "`model_not_found`."}, nullable=False, fill="model"),
    "n": _described({"type": "integer", "minimum": 1, "maximum": MAX_N},
                    "Choices per prompt; with a seed, choice j samples with seed + j."),
    **{name: Val({"type": "number", "minimum": low, "maximum": high}) for name, (low, high) in NUMBER_RANGES.items()},
    **{name: Val({"type": "integer", "minimum": low, "maximum": high}) for name, (low, high) in INTEGER_RANGES.items()},
    "stop": _described({"anyOf": [{"type": "string", "minLength": 1}, {"type": "array", "maxItems": MAX_STOP,
                                                                       "items": {"type": "string", "minLength": 1}}]},
                       f"Up to {MAX_STOP} strings; the text ends before the first one that appears."),
    "stream": _described({"type": "boolean"}, "Answer as server-sent events (text/event-stream)."),
    "stream_options": Obj({"include_usage": BOOLEAN}, doc={"description": "Only together with `stream: true`; "
                          "`include_usage` adds a last chunk with the token counts."}),
    "ignore_eos": _described({"type": "boolean"}, "Keep generating past the end-of-text token."),
    "cache_prompt": _described({"type": "boolean"}, "false: neither reuse nor keep this prompt's KV in the prefix "
                                                    "cache (default true)."),
    "syshax": Obj({"mode": Val({"type": "string"}, fill="routes")},
                  doc={"description": "syshax's extension: run this request alone in one mode (those this daemon "
                                      "serves)."}),
    "min_tokens": _described({"type": "integer", "minimum": 0}, "vLLM's: above 0 only with ignore_eos and no stop "
                             "(the answer then runs to max_tokens, which it may not exceed)."),
    # constraints (constraints.py): OpenAI's, vLLM's and llama-server's forms; a request may use one
    "response_format": _RESPONSE_FORMAT,
    "guided_json": _described({"anyOf": [_SCHEMA.schema, {"type": "string", "description": "The schema as JSON "
                                                                                            "text."}]},
                              "vLLM's: the output validates against this JSON Schema."),
    "guided_regex": _vllm(_REGEX), "guided_choice": _vllm(_CHOICE), "guided_grammar": _vllm(_GBNF),
    "structured_outputs": _STRUCTURED_OUTPUTS, "grammar": _vllm(_GBNF, "llama-server's"),
    "json_schema": _described(_SCHEMA.schema, "llama-server's: the output validates against this JSON Schema."),
}
_TOP_K = _COMMON["top_k"]
assert isinstance(_TOP_K, Val)
_COMMON["top_k"] = Val(_TOP_K.schema | {"description": "0: off."})

CHAT = Obj(_COMMON | {
    "messages": Each(_MESSAGE, {"minItems": 1, "description": "Rendered with the model's own chat template."},
                     nullable=False),
    "max_tokens": _max_tokens("default_max_tokens, within the context"),
    "max_completion_tokens": _max_tokens("max_tokens"),
    "logprobs": _described({"type": "boolean"}, "Each token's logprob (the raw model distribution, as completions' "
                                                "logprobs)."),
    "top_logprobs": _described({"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS},
                               "Alternatives per token; needs logprobs: true."),
    "tools": Each(_TOOL, {"maxItems": MAX_TOOLS, "description": "Functions the model may call. tool_choice `required` "
                          "or a named function constrains the output to one valid call by grammar; `auto` parses "
                          "the calls the model writes."}),
    "tool_choice": OneOf(Obj({"type": Val({"const": "function"}, nullable=False),
                              "function": Obj({"name": STRING}, required=("name",), nullable=False)},
                             required=("type", "function"), nullable=False),
                         alt={"type": "string", "enum": ["none", "auto", "required"]}),
    "parallel_tool_calls": BOOLEAN,
    # reasoning models (reasoning.py): llama-server's reasoning_format, the template's variables (vLLM's and
    # llama-server's chat_template_kwargs), OpenAI's reasoning_effort
    "reasoning_format": _described({"type": "string", "enum": [str(f) for f in ReasoningFormat]},
                                   "llama-server's: `deepseek` reads a reasoning model's <think> block into "
                                   "`reasoning_content`; `none` leaves it in content; `auto` (the default) is "
                                   "deepseek where the model's chat template is a thinking template."),
    "chat_template_kwargs": _described({"type": "object",
                                        "properties": {"enable_thinking": {"type": ["boolean", "null"]}},
                                        "propertyNames": {"not": {"enum": sorted(RENDER_NAMES)}}},
                                       "Variables for the model's chat template (vLLM's and llama-server's), e.g. "
                                       "`enable_thinking: false` (Qwen3)."),
    "reasoning_effort": _described({"type": "string", "enum": list(EFFORTS)}, "`none`: enable_thinking false; the "
                                   "others are passed to the template as `reasoning_effort`."),
}, required=("model", "messages"), nullable=False)

_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
COMPLETIONS = Obj(_COMMON | {
    "prompt": Val({"anyOf": [
        {"type": "string", "minLength": 1},
        _TOKEN_IDS | {"description": "Token ids of the model's vocabulary."},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": MAX_PROMPTS},
        {"type": "array", "items": _TOKEN_IDS, "minItems": 1, "maxItems": MAX_PROMPTS},
    ], "description": "Text, or token ids, or a batch of either: n choices per prompt, choice index "
                      "prompt_index * n + j; usage counts each prompt once."}, nullable=False),
    "max_tokens": _max_tokens("16; 0 only with echo: the prompt alone", low=0),
    "echo": _described({"type": "boolean"}, "The prompt's text before each completion (with logprobs, the prompt "
                                            "tokens' too)."),
    "logprobs": _described({"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS},
                           "Each token's logprob and this many most likely alternatives: the model's raw "
                           "distribution, before temperature and penalties. A torch or vLLM prefill engine (hetero) "
                           "answers 400."),
    "best_of": _described({"type": "integer", "minimum": 1, "maximum": MAX_N},
                          "Only equal to n (no extra candidates are ranked)."),
}, required=("model", "prompt"), nullable=False)

# /v1/responses (responses.py): OpenAI's Responses API
_TEXT = Obj({"type": None, "text": None, "annotations": None, "logprobs": None})
_RESPONSE_TEXT = Tagged({"input_text": _TEXT, "output_text": _TEXT})  # other parts are refused by their type
_ITEM_STATE: dict[str, Spec] = {"type": None, "id": None, "status": None}  # an earlier answer's own keys, sent back
RESPONSES = Obj({
    "model": None, "instructions": None, "max_output_tokens": None, "temperature": None, "top_p": None,
    "top_k": None, "seed": None, "stream": None, "stream_options": Obj({"include_obfuscation": None}),
    "input": Each(Tagged({
        "message": Obj(_ITEM_STATE | {"role": None, "content": Each(_RESPONSE_TEXT), "phase": None}),
        "function_call": Obj(_ITEM_STATE | {"call_id": None, "name": None, "arguments": None}),
        "function_call_output": Obj(_ITEM_STATE | {"call_id": None, "output": Each(_RESPONSE_TEXT)}),
        # an earlier answer's thinking, sent back: it goes with the assistant turn after it
        "reasoning": Obj(_ITEM_STATE | {"summary": Each(Obj({"type": None, "text": None})),
                                        "content": Each(Obj({"type": None, "text": None})),
                                        "encrypted_content": None}),
    }, untagged="message")),
    "tools": Each(Obj({"type": None, "name": None, "description": None, "parameters": _SCHEMA, "strict": None})),
    "tool_choice": OneOf(Obj({"type": None, "name": None})), "parallel_tool_calls": None,
    "text": Obj({"format": Obj({"type": None, "name": None, "schema": _SCHEMA, "strict": None,
                                "description": None})}),
    # read to be refused with what to send instead (stateless) or taken at their default
    "previous_response_id": None, "conversation": None, "include": None, "truncation": None, "background": None,
    "reasoning": Obj({"effort": None, "summary": None}),  # effort as chat's reasoning_effort (reasoning.py)
    "syshax": Obj({"mode": None}),
})

# /v1/messages (messages.py): Anthropic's Messages API
_TEXT_BLOCK = Obj({"type": None, "text": None, "cache_control": None, "citations": None})
_TEXT_BLOCKS = Each(Tagged({"text": _TEXT_BLOCK}))  # other blocks are refused by their type
MESSAGES = Obj({
    "model": None, "max_tokens": None, "system": _TEXT_BLOCKS, "stop_sequences": None, "temperature": None,
    "top_p": None, "top_k": None, "stream": None,
    "messages": Each(Obj({"role": None, "content": Each(Tagged({
        "text": _TEXT_BLOCK,
        "tool_use": Obj({"type": None, "id": None, "name": None, "input": None, "cache_control": None}),
        "tool_result": Obj({"type": None, "tool_use_id": None, "content": _TEXT_BLOCKS, "is_error": None,
                            "cache_control": None}),
        "thinking": Obj({"type": None, "thinking": None, "signature": None, "cache_control": None}),
    }))})),
    "tools": Each(Obj({"type": None, "name": None, "description": None, "input_schema": _SCHEMA,
                       "cache_control": None, "strict": None})),
    "tool_choice": Obj({"type": None, "name": None, "disable_parallel_tool_use": None}),
    "thinking": Obj({"type": None, "budget_tokens": None, "display": None}),  # enabled, adaptive or disabled
    "output_config": Obj({"format": Obj({"type": None, "schema": _SCHEMA})}),
    "metadata": Obj({"user_id": None}),
    "syshax": Obj({"mode": None}),
})
# /v1/messages/count_tokens: the prompt's fields only
MESSAGES_COUNT = Obj({k: v for k, v in MESSAGES.keys.items()
                      if k not in ("max_tokens", "stop_sequences", "temperature", "top_p", "top_k", "stream",
                                   "metadata")})



def check_fields(body: dict, spec: Obj) -> None:
    """Raise a 400 naming the first field of body that spec does not declare (HARMLESS and DEFAULT_ONLY at the
    top level are declared too)."""
    for key, value in body.items():
        if value is None:
            continue  # null is an absent field, here as in validate.py
        if key in spec.keys:
            _check_value(value, spec.keys[key], key)
        elif key in DEFAULT_ONLY:
            if not any(type(value) is type(v) and value == v for v in DEFAULT_ONLY[key]):  # 0 is not false
                allowed = " or ".join(repr(v).replace("True", "true").replace("False", "false")
                                      for v in DEFAULT_ONLY[key])
                raise invalid(f"'{key}' is not supported by this server: it takes only {allowed}, what it does "
                              "anyway.", param=key, code="unsupported_parameter")
        elif key not in HARMLESS:
            raise _unknown(key)


def _check_value(value: Any, spec: Spec, where: str) -> None:
    if spec is None or isinstance(spec, Val):
        return
    if isinstance(spec, OneOf):
        spec = spec.obj
    if isinstance(spec, Tagged):
        if not isinstance(value, dict):
            return
        kind = value.get(spec.tag, spec.untagged)
        spec = spec.kinds.get(kind) if isinstance(kind, str) else None
        if spec is None:
            return  # an unknown kind: the endpoint refuses it by its type
    if isinstance(spec, Each):
        if isinstance(value, list):
            for i, item in enumerate(value):
                _check_value(item, spec.item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for key, sub in value.items():
            path = f"{where}.{key}"
            if sub is None:
                continue
            if key not in spec.keys:
                raise _unknown(path, spec.keys)
            _check_value(sub, spec.keys[key], path)


def _unknown(path: str, known: dict | None = None):
    """The 400 for an undeclared field; inside an object it lists the keys that object takes."""
    where = f"{path.rsplit('.', 1)[0]} takes {', '.join(sorted(known))}" if known else "GET /openapi.json " \
        "lists the fields each endpoint takes"
    return invalid(f"Unrecognized request argument supplied: {path}. This server refuses a field it does not read "
                   f"rather than ignore it (an ignored constraint would break the answer without a word); {where}.",
                   param=path, code="unknown_parameter")
