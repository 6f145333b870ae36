"""The request fields each endpoint reads, declared once; any other field is a 400 that names it.

The policy (OpenAI's own): a field this server does not read is refused, at any depth, rather than
ignored, because an ignored field is often a constraint the client relies on (a schema, a grammar, a
sampling rule) and the answer would break it without a word. Three kinds of field are taken:

* the fields validate.py reads (OpenAI's, and the vLLM and llama-server extensions this server keeps);
* HARMLESS: fields common clients send that change nothing an answer here could show (`user`,
  `metadata`, `store`, ...): accepted and not used;
* DEFAULT_ONLY: the peers' switches, taken only at the value that asks for what this server does anyway
  (vLLM's `use_beam_search: false`, `skip_special_tokens: true`, ...); any other value is a 400.

Values are checked by validate.py; this module checks names. The README lists all three kinds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from syshaxd.api.errors import invalid


@dataclass(frozen=True)
class Obj:
    """An object's known keys, each with the spec of its value (None: a value whose keys are not checked --
    a scalar, a JSON Schema, or an object validate.py reads whole)."""

    keys: dict[str, "Spec"] = field(default_factory=dict)


@dataclass(frozen=True)
class Each:
    """An array whose object items follow `item`."""

    item: "Spec"


@dataclass(frozen=True)
class OneOf:
    """A value that is a string or an object (tool_choice, a message's content as parts): objects follow `obj`."""

    obj: Obj


@dataclass(frozen=True)
class Tagged:
    """An object whose keys depend on the value of its `tag` key (a Responses input item, a Messages content
    block); `untagged` is the kind of one without the tag. An unknown kind is the endpoint's to refuse, by its
    type."""

    kinds: dict[str, Obj]
    tag: str = "type"
    untagged: str | None = None


Spec = Obj | Each | OneOf | Tagged | None

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

_SCHEMA = None  # a JSON Schema: structured.py checks its keywords
_FUNCTION = Obj({"name": None, "description": None, "parameters": _SCHEMA, "strict": None})
_TOOL = Obj({"type": None, "function": _FUNCTION})
_TOOL_CALL = Obj({"id": None, "type": None, "function": Obj({"name": None, "arguments": None}), "index": None})
# the other part types' keys are known, so that validate.py refuses such a part for what it is (not text)
_TEXT_PART = Obj({"type": None, "text": None, "image_url": None, "input_audio": None, "file": None})
_MESSAGE = Obj({"role": None, "content": Each(_TEXT_PART), "name": None, "tool_calls": Each(_TOOL_CALL),
                "tool_call_id": None, "refusal": None, "annotations": None,  # an answer's own, sent back
                "reasoning_content": None, "reasoning": None})  # an answer's thinking, sent back (validate.py)
_RESPONSE_FORMAT = Obj({"type": None, "schema": _SCHEMA,  # schema: llama-server's json_object with a schema
                        "json_schema": Obj({"name": None, "description": None, "schema": _SCHEMA, "strict": None})})
_STRUCTURED_OUTPUTS = Obj({"json": _SCHEMA, "regex": None, "choice": None, "grammar": None, "json_object": None})

# Read by both endpoints (validate.py's _common and what follows it)
_COMMON: dict[str, Spec] = {
    "model": None, "n": None, "temperature": None, "top_p": None, "min_p": None, "top_k": None, "seed": None,
    "presence_penalty": None, "frequency_penalty": None, "repetition_penalty": None, "stop": None,
    "stream": None, "stream_options": Obj({"include_usage": None}), "max_tokens": None, "ignore_eos": None,
    "cache_prompt": None, "syshax": Obj({"mode": None}), "min_tokens": None,
    # constraints (constraints.py): OpenAI's, vLLM's and llama-server's forms
    "response_format": _RESPONSE_FORMAT, "guided_json": _SCHEMA, "guided_regex": None, "guided_choice": None,
    "guided_grammar": None, "structured_outputs": _STRUCTURED_OUTPUTS, "grammar": None, "json_schema": _SCHEMA,
}

CHAT = Obj(_COMMON | {
    "messages": Each(_MESSAGE), "max_completion_tokens": None, "logprobs": None, "top_logprobs": None,
    "tools": Each(_TOOL), "tool_choice": OneOf(Obj({"type": None, "function": Obj({"name": None})})),
    "parallel_tool_calls": None,
    # reasoning models (reasoning.py): llama-server's reasoning_format, the template's variables (vLLM's and
    # llama-server's chat_template_kwargs), OpenAI's reasoning_effort
    "reasoning_format": None, "chat_template_kwargs": None, "reasoning_effort": None,
})
COMPLETIONS = Obj(_COMMON | {"prompt": None, "echo": None, "logprobs": None, "best_of": None})


# /v1/responses (responses.py): OpenAI's Responses API
_TEXT = Obj({"type": None, "text": None, "annotations": None, "logprobs": None})
_RESPONSE_TEXT = Tagged({"input_text": _TEXT, "output_text": _TEXT})  # other parts are refused by their type
_ITEM_STATE = {"type": None, "id": None, "status": None}  # an earlier answer's own keys, sent back
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
            if value not in DEFAULT_ONLY[key]:
                allowed = " or ".join(repr(v).replace("True", "true").replace("False", "false")
                                      for v in DEFAULT_ONLY[key])
                raise invalid(f"'{key}' is not supported by this server: it takes only {allowed}, what it does "
                              "anyway.", param=key, code="unsupported_parameter")
        elif key not in HARMLESS:
            raise _unknown(key)


def _check_value(value: Any, spec: Spec, where: str) -> None:
    if spec is None:
        return
    if isinstance(spec, OneOf):
        spec = spec.obj
    if isinstance(spec, Tagged):
        if not isinstance(value, dict):
            return
        spec = spec.kinds.get(value.get(spec.tag, spec.untagged))
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
    where = f"{path.rsplit('.', 1)[0]} takes {', '.join(sorted(known))}" if known else "see the README for the " \
        "fields each endpoint takes"
    return invalid(f"Unrecognized request argument supplied: {path}. This server refuses a field it does not read "
                   f"rather than ignore it (an ignored constraint would break the answer without a word); {where}.",
                   param=path, code="unknown_parameter")
