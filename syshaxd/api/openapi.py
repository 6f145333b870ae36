"""The OpenAPI 3.1 document of syshaxd's HTTP API, built from the limits validate.py enforces.

Served at /openapi.json. It describes this running daemon: the served model's id,
its context size, the routes it can take (``syshax.mode``), and whether API keys
are required. Request schemas list the fields validate.py accepts with the ranges
it checks, and no others (api/fields.py: an unknown field is a 400); responses give the
OpenAI shapes, the error shape for every 4xx/5xx, and SSE as ``text/event-stream``.
"""

from __future__ import annotations

from syshaxd import __version__
from syshaxd.api import messages, responses
from syshaxd.api.fields import DEFAULT_ONLY, HARMLESS, MESSAGES, RESPONSES, Obj
from syshaxd.api.reasoning import EFFORTS, ReasoningFormat
from syshaxd.sdk.gguf.chat import RENDER_NAMES
from syshaxd.api.validate import CHAT_ROLES, INTEGER_RANGES, MAX_LOGPROBS, MAX_N, MAX_PROMPTS, MAX_STOP, NUMBER_RANGES

ERROR_STATUSES = {
    "400": "The body is invalid: the error's `param` names the field and its message says what is allowed.",
    "401": "API keys are configured and the request carries none or a wrong one (`Authorization: Bearer KEY`).",
    "404": "Unknown model (`code: model_not_found`) or path.",
    "408": "The body did not arrive within client_timeout seconds.",
    "413": "The body is larger than max_body_bytes.",
    "429": "Every batch slot and queue place is taken; retry after `Retry-After` seconds.",
    "500": "Generation failed inside the engine; the message says why.",
    "503": "No engine is ready, the daemon is draining, the request waited past request_timeout, or "
           "max_connections is reached; retry after `Retry-After` seconds.",
}


def _nullable(schema: dict) -> dict:
    """The schema, or null: validate.py treats a null field as an absent one."""
    return {"anyOf": [schema, {"type": "null"}]}


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _errors(*statuses: str) -> dict:
    return {s: {"description": ERROR_STATUSES[s], "content": {"application/json": {"schema": _ref("Error")}}}
            for s in statuses}


def _sampling_fields(model_name: str, routes: list[str]) -> dict:
    fields = {
        "model": {"type": "string", "enum": [model_name],
                  "description": "The id /v1/models lists; any other gets 404 `model_not_found`."},
        "n": _nullable({"type": "integer", "minimum": 1, "maximum": MAX_N,
                        "description": "Choices per prompt; with a seed, choice j samples with seed + j."}),
        "stream": _nullable({"type": "boolean", "description": "Answer as server-sent events (text/event-stream)."}),
        "stream_options": _nullable({"type": "object", "properties": {"include_usage": _nullable({"type": "boolean"})},
                                     "additionalProperties": False,
                                     "description": "Only together with `stream: true`; `include_usage` adds a "
                                                    "last chunk with the token counts."}),
        "stop": _nullable({"anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOP},
        ], "description": f"Up to {MAX_STOP} strings; the text ends before the first one that appears."}),
        "ignore_eos": _nullable({"type": "boolean", "description": "Keep generating past the end-of-text token."}),
        "min_tokens": _nullable({"type": "integer", "minimum": 0, "description": "vLLM's: above 0 only with "
                                 "ignore_eos and no stop (the answer then runs to max_tokens, which it may not "
                                 "exceed)."}),
        "cache_prompt": _nullable({"type": "boolean", "description": "false: neither reuse nor keep this prompt's "
                                   "KV in the prefix cache (default true)."}),
        "syshax": _nullable({"type": "object", "properties": {
            "mode": _nullable({"type": "string", "enum": routes}),
        }, "additionalProperties": False, "description": "syshax's extension: run this request alone in one mode "
                                                          f"({', '.join(routes)} on this daemon)."}),
    } | _constraint_fields() | _accepted_fields()
    for name, (low, high) in NUMBER_RANGES.items():
        fields[name] = _nullable({"type": "number", "minimum": low, "maximum": high})
    for name, (low, high) in INTEGER_RANGES.items():
        fields[name] = _nullable({"type": "integer", "minimum": low, "maximum": high})
    fields["top_k"]["description"] = "0: off."
    return fields


def _constraint_fields() -> dict:
    """Every way to constrain the output (api/constraints.py); a request may use one."""
    schema = {"type": "object", "description": "A JSON Schema; keywords the grammar cannot enforce (minimum, not, "
                                               "oneOf, ...) are a 400 naming them."}
    regex = {"type": "string", "minLength": 1, "description": "The whole output matches this regular expression "
             "(no lookarounds, backreferences or lazy quantifiers)."}
    choice = {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1,
              "description": "The output is exactly one of these strings."}
    gbnf = {"type": "string", "minLength": 1, "description": "A GBNF grammar with a rule named root."}
    return {
        "response_format": _nullable({"anyOf": [
            {"type": "object", "required": ["type"], "additionalProperties": False,
             "properties": {"type": {"type": "string", "enum": ["text", "json_object"]},
                            "schema": schema | {"description": "llama-server's: with json_object, the output "
                                                               "validates against this JSON Schema."}}},
            {"type": "object", "required": ["type", "json_schema"], "additionalProperties": False,
             "properties": {"type": {"const": "json_schema"}, "json_schema": {
                 "type": "object", "required": ["name"], "additionalProperties": False,
                 "properties": {"name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
                                "description": {"type": "string"}, "schema": schema,
                                "strict": _nullable({"type": "boolean"})}}}}],
            "description": "json_object and json_schema constrain sampling with a grammar: the output parses "
                           "(and validates)."}),
        "guided_json": _nullable({"anyOf": [schema, {"type": "string", "description": "The schema as JSON text."}],
                                  "description": "vLLM's: the output validates against this JSON Schema."}),
        "guided_regex": _nullable(regex | {"description": "vLLM's: " + regex["description"]}),
        "guided_choice": _nullable(choice | {"description": "vLLM's: " + choice["description"]}),
        "guided_grammar": _nullable(gbnf | {"description": "vLLM's: " + gbnf["description"]}),
        "structured_outputs": _nullable({
            "type": "object", "properties": {"json": schema, "regex": regex, "choice": choice, "grammar": gbnf,
                                             "json_object": {"type": "boolean"}},
            "additionalProperties": False, "minProperties": 1, "maxProperties": 1,
            "description": "vLLM's newer form: exactly one of json, regex, choice, grammar, json_object."}),
        "grammar": _nullable(gbnf | {"description": "llama-server's: " + gbnf["description"]}),
        "json_schema": _nullable(schema | {"description": "llama-server's: the output validates against this "
                                                          "JSON Schema."}),
    }


def _accepted_fields() -> dict:
    """Fields clients send that change nothing here (HARMLESS), and the peers' switches taken at the value that
    asks for what this server does anyway (DEFAULT_ONLY)."""
    fields = {name: {"description": f"Accepted and not used: {why}."} for name, why in HARMLESS.items()}
    for name, values in DEFAULT_ONLY.items():
        fields[name] = _nullable({"enum": list(values), "description": "Only the value that asks for what this "
                                                                       "server does anyway."})
    return fields


def _max_tokens(n_ctx: int, default: str, low: int = 1) -> dict:
    return _nullable({"type": "integer", "minimum": low, "maximum": n_ctx,
                      "description": f"Tokens to generate (default {default}); the prompt plus this must fit "
                                     f"the context of {n_ctx} tokens, else 400 `context_length_exceeded`."})


def _completion_request(common: dict, n_ctx: int) -> dict:
    prompt = {"anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1,
         "description": "Token ids of the model's vocabulary."},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": MAX_PROMPTS},
        {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
         "minItems": 1, "maxItems": MAX_PROMPTS},
    ], "description": "Text, or token ids, or a batch of either: n choices per prompt, choice index "
                      "prompt_index * n + j; usage counts each prompt once."}
    return {
        "type": "object",
        "required": ["model", "prompt"],
        "properties": common | {
            "prompt": prompt,
            "max_tokens": _max_tokens(n_ctx, "16; 0 only with echo: the prompt alone", low=0),
            "echo": _nullable({"type": "boolean", "description": "The prompt's text before each completion (with "
                                                                 "logprobs, the prompt tokens' too)."}),
            "best_of": _nullable({"type": "integer", "minimum": 1, "maximum": MAX_N,
                                  "description": "Only equal to n (no extra candidates are ranked)."}),
            "logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS,
                                   "description": "Each token's logprob and this many most likely alternatives: "
                                                  "the model's raw distribution, before temperature and "
                                                  "penalties. A torch or vLLM prefill engine (hetero) answers 400."}),
        },
        "additionalProperties": False,
    }


def _chat_request(common: dict, n_ctx: int) -> dict:
    text_part = {"type": "object", "required": ["type", "text"], "additionalProperties": False,
                 "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}
    message = {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"type": "string", "enum": list(CHAT_ROLES)},
            "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": text_part}],
                        "description": "Text, or text parts; an assistant message may send null."},
            "tool_calls": {"type": "array", "description": "An assistant message's earlier calls (OpenAI's shape).",
                           "items": {"type": "object", "required": ["id", "type", "function"]}},
            "tool_call_id": {"type": "string", "description": "Required in a `tool` message: the call it answers."},
            "name": {"type": "string"}, "refusal": {}, "annotations": {},
            **{name: _nullable({"type": "string", "description": "An assistant message's thinking, sent back (an "
                                                                 "answer's `reasoning_content`); templates that "
                                                                 "render it (Qwen3's) get it."})
               for name in ("reasoning_content", "reasoning")},
        },
        "additionalProperties": False,
    }
    return {
        "type": "object",
        "required": ["model", "messages"],
        "properties": common | {
            "messages": {"type": "array", "items": message, "minItems": 1,
                         "description": "Rendered with the model's own chat template."},
            "max_tokens": _max_tokens(n_ctx, "default_max_tokens, within the context"),
            "max_completion_tokens": _max_tokens(n_ctx, "max_tokens"),
            "logprobs": _nullable({"type": "boolean", "description": "Each token's logprob (the raw model "
                                   "distribution, as completions' logprobs)."}),
            "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS,
                                       "description": "Alternatives per token; needs logprobs: true."}),
            "tools": _nullable({"type": "array", "maxItems": 128, "items": _ref("Tool"),
                                "description": "Functions the model may call. tool_choice `required` or a named "
                                               "function constrains the output to one valid call by grammar; "
                                               "`auto` parses the calls the model writes."}),
            "tool_choice": _nullable({"anyOf": [
                {"type": "string", "enum": ["none", "auto", "required"]},
                {"type": "object", "required": ["type", "function"],
                 "properties": {"type": {"const": "function"},
                                "function": {"type": "object", "required": ["name"],
                                             "properties": {"name": {"type": "string"}}}}}]}),
            "parallel_tool_calls": _nullable({"type": "boolean"}),
            "reasoning_format": _nullable({"type": "string", "enum": [str(f) for f in ReasoningFormat],
                                           "description": "llama-server's: `deepseek` reads a reasoning model's "
                                                          "<think> block into `reasoning_content`; `none` leaves it "
                                                          "in content; `auto` (the default) is deepseek where the "
                                                          "model's chat template is a thinking template."}),
            "chat_template_kwargs": _nullable({
                "type": "object", "properties": {"enable_thinking": _nullable({"type": "boolean"})},
                "propertyNames": {"not": {"enum": sorted(RENDER_NAMES)}},
                "description": "Variables for the model's chat template (vLLM's and llama-server's), e.g. "
                               "`enable_thinking: false` (Qwen3)."}),
            "reasoning_effort": _nullable({"type": "string", "enum": list(EFFORTS),
                                           "description": "`none`: enable_thinking false; the others are passed "
                                                          "to the template as `reasoning_effort`."}),
        },
        "additionalProperties": False,
    }


def _declared(spec: Obj, typed: dict) -> dict:
    """Every field api/fields.py declares for the endpoint and the ones every endpoint accepts (typed where given
    here); any other is a 400."""
    declared = _accepted_fields() | {name: {} for name in sorted(spec.keys)}
    return declared | {name: schema for name, schema in typed.items() if name in declared}


def _other_api_schemas(model_name: str, n_ctx: int) -> dict:
    """/v1/responses and /v1/messages: the fields their modules declare; their own shapes answer."""
    model = {"type": "string", "enum": [model_name]}
    tokens = {"type": "integer", "minimum": 1, "maximum": n_ctx}
    return {
        "ResponseRequest": {
            "type": "object", "required": ["model", "input"], "additionalProperties": False,
            "description": "OpenAI's Responses API, stateless: previous_response_id and conversation are a 400.",
            "properties": _declared(RESPONSES, {
                "model": model, "max_output_tokens": _nullable(tokens), "stream": _nullable({"type": "boolean"}),
                "input": {"anyOf": [{"type": "string", "minLength": 1},
                                    {"type": "array", "minItems": 1, "items": {"type": "object"}}],
                          "description": f"Text, or items of type {', '.join(responses.ITEM_TYPES)}."},
                "instructions": _nullable({"type": "string"}),
                "temperature": _nullable({"type": "number", "minimum": 0, "maximum": 2}),
                "store": _nullable({"type": "boolean", "description": "Accepted; the answer says false."})})},
        "Response": {"type": "object", "required": ["id", "object", "status", "output"],
                     "properties": {"id": {"type": "string"}, "object": {"const": "response"},
                                    "status": {"type": "string"}, "output": {"type": "array"},
                                    "usage": {"type": ["object", "null"]}}},
        "MessagesRequest": {
            "type": "object", "required": ["model", "messages", "max_tokens"], "additionalProperties": False,
            "description": "Anthropic's Messages API.",
            "properties": _declared(MESSAGES, {
                "model": model, "max_tokens": tokens, "stream": _nullable({"type": "boolean"}),
                "messages": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["role", "content"],
                    "properties": {"role": {"enum": list(messages.ROLES)},
                                   "content": {"anyOf": [{"type": "string"}, {"type": "array"}]}}}},
                "temperature": _nullable({"type": "number", "minimum": 0, "maximum": 1})})},
        "Message": {"type": "object", "required": ["id", "type", "role", "content", "stop_reason", "usage"],
                    "properties": {"id": {"type": "string"}, "type": {"const": "message"},
                                   "role": {"const": "assistant"}, "content": {"type": "array"},
                                   "stop_reason": {"type": ["string", "null"]}, "usage": {"type": "object"}}},
        "AnthropicError": {"type": "object", "required": ["type", "error"],
                           "properties": {"type": {"const": "error"}, "error": {
                               "type": "object", "required": ["type", "message"],
                               "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}}},
    }


def _other_api_op(summary: str, request: str, answer: str, error: str, secured: list) -> dict:
    errors = {s: {"description": ERROR_STATUSES[s], "content": {"application/json": {"schema": _ref(error)}}}
              for s in ("400", "401", "404", "413", "429", "500", "503")}
    return {"post": {
        "summary": summary, "security": secured,
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {"200": {"description": "The answer, or with `stream: true` its typed server-sent events.",
                              "content": {"application/json": {"schema": _ref(answer)},
                                          "text/event-stream": {"schema": _typed_event()}}}} | errors}}


def _typed_event() -> dict:
    """One server-sent event of the Responses or Messages API: `event: <type>`, and the event as JSON data."""
    return {"type": "object", "required": ["data"],
            "properties": {"event": {"type": "string"}, "id": {"type": "string"},
                           "data": {"type": "string", "contentMediaType": "application/json",
                                    "contentSchema": {"type": "object", "required": ["type"]}}}}


def _token_schemas(model_name: str) -> dict:
    """/tokenize and /detokenize: llama-server's fields, and vLLM's names for the same things."""
    model = _nullable({"type": "string", "enum": [model_name], "description": "Optional; another gets 404."})
    flag = _nullable({"type": "boolean"})
    text_part = {"type": "object", "required": ["type", "text"], "additionalProperties": False,
                 "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}
    message = {"type": "object", "required": ["role", "content"],
               "properties": {"role": {"type": "string", "enum": list(CHAT_ROLES)},
                              "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": text_part}]}}}
    token_ids = {"type": "array", "items": {"type": "integer", "minimum": 0}}
    piece = {"type": "object", "required": ["id", "piece"],
             "properties": {"id": {"type": "integer"},
                            "piece": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "integer"}}],
                                      "description": "The text, or its bytes when not whole UTF-8."}}}
    return {
        "TokenizeRequest": {
            "description": "One of `content` (llama-server), `prompt` (vLLM) or `messages` (rendered with the "
                           "model's chat template, as chat completions are).",
            "anyOf": [{"required": ["content"]}, {"required": ["prompt"]}, {"required": ["messages"]}],
            "type": "object",
            "properties": {"content": {"type": "string"}, "prompt": {"type": "string"},
                           "messages": {"type": "array", "items": message, "minItems": 1},
                           "add_special": flag, "add_special_tokens": flag, "with_pieces": flag,
                           "add_generation_prompt": _nullable({"type": "boolean", "enum": [True]}),
                           "model": model},
            "additionalProperties": True,
        },
        "Tokenized": {"type": "object", "required": ["tokens", "count", "max_model_len"],
                      "properties": {"tokens": {"anyOf": [token_ids, {"type": "array", "items": piece}]},
                                     "count": {"type": "integer"}, "max_model_len": {"type": "integer"}}},
        "DetokenizeRequest": {"type": "object", "required": ["tokens"],
                              "properties": {"tokens": token_ids, "model": model}, "additionalProperties": True},
        "TokenizerInfo": {"type": "object", "required": ["eos_token", "vocab_size", "model_max_length"],
                          "properties": {"tokenizer_class": {"type": "string"}, "vocab_size": {"type": "integer"},
                                         "model_max_length": {"type": "integer"},
                                         **{k: {"type": ["string", "null"]} for k in
                                            ("bos_token", "eos_token", "pad_token", "chat_template")}}},
        "Detokenized": {"type": "object", "required": ["content"],
                        "properties": {"content": {"type": "string"}, "prompt": {"type": "string"}}},
    }


def _token_op(summary: str, request: str, answer: str, secured: list) -> dict:
    return {"post": {"summary": summary, "security": secured,
                     "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
                     "responses": {"200": {"description": summary,
                                           "content": {"application/json": {"schema": _ref(answer)}}}}
                     | _errors("400", "401", "404", "413")}}


def _schemas() -> dict:
    usage = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
             "properties": {k: {"type": "integer", "minimum": 0}
                            for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
             | {"prompt_tokens_details": {
                 "type": "object", "description": "`cached_tokens`: prompt tokens whose KV came from the prefix cache",
                 "properties": {"cached_tokens": {"type": "integer", "minimum": 0}}}}}
    head = {"id": {"type": "string"}, "created": {"type": "integer"}, "model": {"type": "string"},
            "system_fingerprint": {"type": "string"}}
    finish = {"type": "string", "enum": ["stop", "length", "tool_calls"]}
    number_or_null = {"type": ["number", "null"]}
    completion_lp = {"anyOf": [{"type": "null"}, {
        "type": "object", "required": ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
        "properties": {"tokens": {"type": "array", "items": {"type": "string"}},
                       "token_logprobs": {"type": "array", "items": number_or_null},
                       "top_logprobs": {"type": "array", "items": {"anyOf": [
                           {"type": "null"}, {"type": "object", "additionalProperties": {"type": "number"}}]}},
                       "text_offset": {"type": "array", "items": {"type": "integer"}}}}]}
    chat_token = {"type": "object", "required": ["token", "logprob", "bytes"],
                  "properties": {"token": {"type": "string"}, "logprob": {"type": "number"},
                                 "bytes": {"type": "array", "items": {"type": "integer"}}}}
    chat_lp = {"anyOf": [{"type": "null"}, {
        "type": "object", "required": ["content"],
        "properties": {"content": {"type": "array", "items": chat_token | {"properties": chat_token["properties"] | {
            "top_logprobs": {"type": "array", "items": chat_token}}}},
                       "refusal": {"type": "null"}}}]}
    tool_call = {"type": "object", "required": ["id", "type", "function"],
                 "properties": {"id": {"type": "string"}, "type": {"const": "function"},
                                "function": {"type": "object", "required": ["name", "arguments"],
                                             "properties": {"name": {"type": "string"},
                                                            "arguments": {"type": "string"}}}}}
    tool_call_delta = {"type": "object", "required": ["index"],
                       "properties": {"index": {"type": "integer"}, "id": {"type": "string"},
                                      "type": {"const": "function"},
                                      "function": {"type": "object", "properties": {
                                          "name": {"type": "string"}, "arguments": {"type": "string"}}}}}
    route = {"description": "syshax's note of where the request ran (also the X-Syshax-Route header): `route` "
                            "cpu, gpu or hetero; in auto mode the decider's `reason`, what decided (`decided_by`: "
                            "rule:NAME for a routing rule, measured, thresholds, gpu_not_ready, logprobs), and "
                            "`moved_to` when an offloaded decode moved back to the GPU.",
             "type": "object", "required": ["route"],
             "properties": {"route": {"type": "string"}, "reason": {"type": "string"},
                            "decided_by": {"type": "string"}, "moved_to": {"type": "string"}}}
    return {
        "Route": route,
        "Tool": {"type": "object", "required": ["type", "function"], "additionalProperties": False,
                 "properties": {"type": {"const": "function"}, "function": {
                     "type": "object", "required": ["name"], "additionalProperties": False,
                     "properties": {"name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
                                    "description": {"type": "string"},
                                    "parameters": {"type": "object", "description": "A JSON Schema of the "
                                                   "arguments (the same keywords as response_format's)."},
                                    "strict": _nullable({"type": "boolean"})}}}},
        "Error": {
            "type": "object", "required": ["error"],
            "properties": {"error": {
                "type": "object", "required": ["message", "type", "param", "code"],
                "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                               "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}},
            }},
        },
        "Usage": usage,
        "Completion": {
            "type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
            "properties": head | {
                "object": {"const": "text_completion"},
                "choices": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["index", "text", "finish_reason"],
                    "properties": {"index": {"type": "integer"}, "text": {"type": "string"},
                                   "logprobs": completion_lp, "finish_reason": finish}}},
                "usage": _ref("Usage"),
                "syshax": _ref("Route"),
            },
        },
        "ChatCompletion": {
            "type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
            "properties": head | {
                "object": {"const": "chat.completion"},
                "choices": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["index", "message", "finish_reason"],
                    "properties": {"index": {"type": "integer"}, "logprobs": chat_lp,
                                   "finish_reason": finish,
                                   "message": {"type": "object", "required": ["role", "content"],
                                               "properties": {"role": {"const": "assistant"},
                                                              "content": {"type": ["string", "null"]},
                                                              "reasoning_content": {"type": ["string", "null"]},
                                                              "reasoning": {"type": ["string", "null"]},
                                                              "tool_calls": {"type": "array",
                                                                             "items": tool_call}}}}}},
                "usage": _ref("Usage"),
                "syshax": _ref("Route"),
            },
        },
        "CompletionChunk": {
            "description": "One `data:` event of a streamed completion; the stream ends with `data: [DONE]`.",
            "type": "object", "required": ["id", "object", "choices"],
            "properties": head | {"object": {"const": "text_completion"},
                                  "choices": {"type": "array", "items": {"type": "object", "properties": {
                                      "index": {"type": "integer"}, "text": {"type": "string"},
                                      "logprobs": completion_lp,
                                      "finish_reason": {"type": ["string", "null"]}}}},
                                  "usage": _ref("Usage"), "syshax": _ref("Route")},
        },
        "ChatCompletionChunk": {
            "description": "One `data:` event of a streamed chat completion; the first carries the role, "
                           "the stream ends with `data: [DONE]`. An error after the first event arrives as "
                           "one event of the Error shape.",
            "type": "object", "required": ["id", "object", "choices"],
            "properties": head | {"object": {"const": "chat.completion.chunk"},
                                  "choices": {"type": "array", "items": {"type": "object", "properties": {
                                      "index": {"type": "integer"},
                                      "delta": {"type": "object", "properties": {
                                          "role": {"type": "string"}, "content": {"type": "string"},
                                          "reasoning_content": {"type": "string"}, "reasoning": {"type": "string"},
                                          "tool_calls": {"type": "array", "items": tool_call_delta}}},
                                      "logprobs": chat_lp,
                                      "finish_reason": {"type": ["string", "null"]}}}},
                                  "usage": _ref("Usage"), "syshax": _ref("Route")},
        },
        "Model": {"type": "object", "required": ["id", "object", "created", "owned_by"],
                  "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                                 "created": {"type": "integer"}, "owned_by": {"type": "string"}}},
        "ModelList": {"type": "object", "required": ["object", "data"],
                      "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": _ref("Model")}}},
        "Health": {"type": "object", "required": ["status", "mode", "workers"],
                   "properties": {"status": {"type": "string", "enum": ["ok", "loading", "failed", "draining"]},
                                  "mode": {"type": "string"}, "reason": {"type": "string"},
                                  "workers": {"type": "array", "items": {"type": "object", "properties": {
                                      "name": {"type": "string"}, "state": {"type": "string"},
                                      "error": {"type": ["string", "null"]}}}}}},
        "Status": {"type": "object", "required": ["mode", "ready", "in_flight", "workers"],
                   "description": "The scheduler's view: workers, queue, KV ring, HTTP connections.",
                   "additionalProperties": True},
    }


def _sse_event(chunk: str) -> dict:
    """One server-sent event of a stream (as OpenAPI 3.1 tools read a text/event-stream schema)."""
    return {
        "type": "object", "required": ["data"],
        "description": f"Each event's data is one {chunk} as JSON; an engine failure mid-stream sends one Error "
                       "instead; the last event is `data: [DONE]`.",
        "properties": {
            "data": {"anyOf": [
                {"const": "[DONE]"},
                {"type": "string", "contentMediaType": "application/json",
                 "contentSchema": {"anyOf": [_ref(chunk), _ref("Error")]}},
            ]},
            "event": {"type": "string"},
            "id": {"type": "string"},
        },
    }


def _generation(summary: str, request: str, body: str, chunk: str, secured: list) -> dict:
    return {
        "summary": summary,
        "security": secured,
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {
            "200": {"description": "The completion, or with `stream: true` its server-sent events.",
                    "content": {"application/json": {"schema": _ref(body)},
                                "text/event-stream": {"schema": _sse_event(chunk)}}},
        } | _errors("400", "401", "404", "413", "429", "500", "503"),
    }


def build_document(model_name: str, n_ctx: int, routes: list[str], keys_required: bool,
                   metrics_require_key: bool) -> dict:
    """The OpenAPI document for a daemon serving model_name with this context size and these routes."""
    secured = [{"bearerAuth": []}] if keys_required else []
    common = _sampling_fields(model_name, routes)
    schemas = _schemas() | {"CompletionRequest": _completion_request(common, n_ctx),
                            "ChatCompletionRequest": _chat_request(common, n_ctx)} | _token_schemas(model_name) \
        | _other_api_schemas(model_name, n_ctx)
    json_200 = lambda ref, what: {"200": {"description": what,  # noqa: E731
                                          "content": {"application/json": {"schema": _ref(ref)}}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "syshaxd", "version": __version__,
                 "description": "OpenAI-compatible completions from syshax's heterogeneous inference runtime."},
        "paths": {
            "/v1/completions": {"post": _generation("Text completion", "CompletionRequest", "Completion",
                                                    "CompletionChunk", secured)},
            "/v1/chat/completions": {"post": _generation("Chat completion", "ChatCompletionRequest",
                                                         "ChatCompletion", "ChatCompletionChunk", secured)},
            "/v1/responses": _other_api_op("OpenAI's Responses API (stateless)", "ResponseRequest", "Response",
                                           "Error", secured),
            "/v1/messages": _other_api_op("Anthropic's Messages API", "MessagesRequest", "Message", "AnthropicError",
                                          secured),
            "/tokenize": _token_op("Text or chat messages to the model's token ids", "TokenizeRequest", "Tokenized",
                                   secured),
            "/detokenize": _token_op("Token ids to text", "DetokenizeRequest", "Detokenized", secured),
            "/tokenizer_info": {"get": {"summary": "The vocabulary's special tokens and chat template (vLLM's)",
                                        "security": secured,
                                        "responses": json_200("TokenizerInfo", "The tokenizer.") | _errors("401")}},
            "/v1/models": {"get": {"summary": "The served model", "security": secured,
                                   "responses": json_200("ModelList", "The one model this daemon serves.")
                                   | _errors("401")}},
            "/v1/models/{model}": {"get": {
                "summary": "One model", "security": secured,
                "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": json_200("Model", "The model.") | _errors("401", "404")}},
            "/v1/syshax/status": {"get": {"summary": "Scheduler, workers and KV ring", "security": secured,
                                          "responses": json_200("Status", "The daemon's state.") | _errors("401")}},
            "/health": {"get": {"summary": "Liveness and readiness (never needs a key)", "security": [],
                                "responses": {
                                    "200": {"description": "Every engine worker is ready.",
                                            "content": {"application/json": {"schema": _ref("Health")}}},
                                    "503": {"description": "Loading, failed (the workers say why) or draining.",
                                            "content": {"application/json": {"schema": _ref("Health")}}}}}},
            "/metrics": {"get": {"summary": "Prometheus metrics",
                                 "security": [{"bearerAuth": []}] if keys_required and metrics_require_key else [],
                                 "responses": {"200": {"description": "Prometheus text (OpenMetrics on request).",
                                                       "content": {"text/plain": {"schema": {"type": "string"}},
                                                                   "application/openmetrics-text": {
                                                                       "schema": {"type": "string"}}}}}
                                 | (_errors("401") if keys_required and metrics_require_key else {})}},
            "/openapi.json": {"get": {"summary": "This document", "security": [],
                                      "responses": {"200": {"description": "OpenAPI 3.1.",
                                                            "content": {"application/json": {
                                                                "schema": {"type": "object"}}}}}}},
        },
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer",
                                               "description": "One of the keys in api_keys / api_key_file."}},
        },
    }
