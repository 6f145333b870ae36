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


Spec = Obj | Each | OneOf | None

# Accepted at the top level of chat and completions, and not used: nothing in an answer here depends on them.
HARMLESS = {
    "user": "an end-user id for the provider's abuse monitoring",
    "safety_identifier": "the newer name of user",
    "metadata": "tags for the provider's stored completions",
    "store": "whether the provider stores the completion; nothing is stored here",
    "service_tier": "the provider's processing tier; there is one here",
    "prompt_cache_key": "a hint for the provider's prompt cache; the prefix cache here needs none",
    "reasoning_effort": "for reasoning models; the served model does not reason apart from its answer",
    "verbosity": "for reasoning models",
    "guided_decoding_backend": "vLLM's choice of grammar library; one grammar path serves all here",
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
                "tool_call_id": None, "refusal": None, "annotations": None})  # an answer's own, sent back
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
})
COMPLETIONS = Obj(_COMMON | {"prompt": None, "echo": None, "logprobs": None, "best_of": None})


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
                raise _unknown(path)
            _check_value(sub, spec.keys[key], path)


def _unknown(path: str):
    return invalid(f"Unrecognized request argument supplied: {path}. This server refuses a field it does not read "
                   "rather than ignore it (an ignored constraint would break the answer without a word); see the "
                   "README for the fields it takes.", param=path, code="unknown_parameter")
