"""The OpenAPI 3.1 document of syshaxd's HTTP API (/openapi.json), written from api/core/fields.py's declarations.

It describes this running daemon: the served model's id, its context size, the routes it can take
(``syshax.mode``), and whether API keys are required. Chat's and completions' request schemas are
generated from the declarations validation reads (api/core/fields.py: each field's type, enum and range,
each object's required keys, and no other field: an unknown one is a 400); the Responses and Messages
requests list their declared fields, typed where given here. Responses give OpenAI's and Anthropic's
shapes, the error shape for every 4xx/5xx, and streams as ``text/event-stream``; /tokenize, /detokenize,
/tokenizer_info, the model list, health, status and metrics are described too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from syshaxd import __version__
from syshaxd.api import messages, responses
from syshaxd.api.core.fields import (CHAT, CHAT_ROLES, COMPLETIONS, DEFAULT_ONLY, HARMLESS, MESSAGES, MESSAGES_COUNT,
                                     RESPONSES, Each, Obj, OneOf, Spec, Val)
from syshaxd.api.openai.vector_schemas import nullable as _nullable
from syshaxd.api.openai.vector_schemas import vector_schemas

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


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _errors(*statuses: str, shape: str = "Error") -> dict:
    """The error answers of these statuses, in OpenAI's shape (Error) or another API's (AnthropicError)."""
    return {s: {"description": ERROR_STATUSES[s], "content": {"application/json": {"schema": _ref(shape)}}}
            for s in statuses}


def _accepted_fields() -> dict:
    """Fields clients send that change nothing here (HARMLESS), and the peers' switches taken at the value that
    asks for what this server does anyway (DEFAULT_ONLY)."""
    fields = {name: {"description": f"Accepted and not used: {why}."} for name, why in HARMLESS.items()}
    for name, values in DEFAULT_ONLY.items():
        fields[name] = _nullable({"enum": list(values), "description": "Only the value that asks for what this "
                                                                       "server does anyway."})
    return fields


@dataclass(frozen=True)
class _Daemon:
    """What the running daemon puts into a declared field's schema (fields.Val.fill)."""

    model_name: str
    n_ctx: int
    routes: list[str]

    def fill(self, val: Val) -> dict:
        if val.fill == "model":
            return val.schema | {"enum": [self.model_name]}
        if val.fill == "n_ctx":
            return val.schema | {"maximum": self.n_ctx}
        if val.fill == "routes":
            return val.schema | {"enum": list(self.routes)}
        return dict(val.schema)


def _schema_of(spec: Spec, daemon: _Daemon) -> dict:
    """The JSON Schema of a field as api/core/fields.py declares it: an object takes its declared keys and no others."""
    if spec is None:
        return {}
    if isinstance(spec, Val):
        schema = daemon.fill(spec)
    elif isinstance(spec, Obj):
        schema = {"type": "object", "properties": {k: _schema_of(v, daemon) for k, v in spec.keys.items()},
                  "additionalProperties": False} | ({"required": list(spec.required)} if spec.required else {}) \
            | spec.doc
    elif isinstance(spec, Each):
        schema = {"type": "array", "items": _schema_of(spec.item, daemon)} | spec.doc
    elif isinstance(spec, OneOf):  # null, where taken, is a third branch: clients read the first two
        return {"anyOf": [spec.alt, _schema_of(spec.obj, daemon)] + ([{"type": "null"}] if spec.nullable else [])} \
            | spec.doc
    else:  # Tagged: the endpoint refuses an unknown kind by its type
        return {"type": "object"}
    return _nullable(schema) if spec.nullable else schema


def _request(spec: Obj, daemon: _Daemon) -> dict:
    """A request body's schema: the fields the endpoint declares (api/core/fields.py) and those every endpoint
    accepts."""
    schema = _schema_of(spec, daemon)
    schema["properties"] = _accepted_fields() | schema["properties"]
    return schema


def _declared(spec: Obj, typed: dict) -> dict:
    """Every field api/core/fields.py declares for the endpoint and the ones every endpoint accepts (typed where given
    here); any other is a 400."""
    declared = _accepted_fields() | {name: {} for name in sorted(spec.keys)}
    return declared | {name: schema for name, schema in typed.items() if name in declared}


def _other_api_schemas(model_name: str, n_ctx: int) -> dict:
    """/v1/responses and /v1/messages: the fields their modules declare; their own shapes answer."""
    model = {"type": "string", "enum": [model_name]}
    tokens = {"type": "integer", "minimum": 1, "maximum": n_ctx}
    messages_schema = {"type": "array", "minItems": 1, "items": {
        "type": "object", "required": ["role", "content"],
        "properties": {"role": {"enum": list(messages.ROLES)},
                       "content": {"anyOf": [{"type": "string"}, {"type": "array"}]}}}}
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
                "messages": messages_schema,
                "temperature": _nullable({"type": "number", "minimum": 0, "maximum": 1})})},
        "CountTokensRequest": {
            "type": "object", "required": ["model", "messages"], "additionalProperties": False,
            "description": "A Messages request's prompt, to count: no max_tokens, nothing generated.",
            "properties": _declared(MESSAGES_COUNT, {"model": model, "messages": messages_schema})},
        "TokenCount": {"type": "object", "required": ["input_tokens"],
                       "properties": {"input_tokens": {"type": "integer", "minimum": 0}}},
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
    errors = _errors("400", "401", "404", "413", "429", "500", "503", shape=error)
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


def _token_op(summary: str, request: str, answer: str, secured: list, *more_errors: str) -> dict:
    return {"post": {"summary": summary, "security": secured,
                     "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
                     "responses": {"200": {"description": summary,
                                           "content": {"application/json": {"schema": _ref(answer)}}}}
                     | _errors("400", "401", "404", "413", *more_errors)}}


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
    chat_token: dict[str, Any] = {"type": "object", "required": ["token", "logprob", "bytes"],
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
    secured: list[dict] = [{"bearerAuth": []}] if keys_required else []
    daemon = _Daemon(model_name, n_ctx, routes)
    schemas = _schemas() | {"CompletionRequest": _request(COMPLETIONS, daemon),
                            "ChatCompletionRequest": _request(CHAT, daemon)} | _token_schemas(model_name) \
        | _other_api_schemas(model_name, n_ctx) | vector_schemas()
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
            "/v1/messages/count_tokens": {"post": {
                "summary": "A Messages request's prompt in tokens: the chat template rendered with the tools",
                "security": secured,
                "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(
                    "CountTokensRequest")}}},
                "responses": json_200("TokenCount", "The prompt's tokens.")
                | _errors("400", "401", "404", "413", shape="AnthropicError")}},
            "/v1/embeddings": _token_op("Vectors of texts or token ids from an embedding model of [[models]]: one "
                                        "per input, in order, each of length 1", "EmbeddingRequest", "EmbeddingList",
                                        secured, "500", "503"),
            "/v1/rerank": _token_op("Documents scored against a query by a reranker of [[models]], best first",
                                    "RerankRequest", "RerankList", secured, "500", "503"),
            "/rerank": _token_op("The same as POST /v1/rerank, at llama-server's other path", "RerankRequest",
                                 "RerankList", secured, "500", "503"),
            "/models/load": _token_op("Load a model of [[models]] now (llama-server's router)", "ModelName",
                                      "Success", secured, "503"),
            "/models/unload": _token_op("Unload a model of [[models]] once its requests are done (llama-server's "
                                        "router)", "ModelName", "Success", secured),
            "/tokenize": _token_op("Text or chat messages to the model's token ids", "TokenizeRequest", "Tokenized",
                                   secured),
            "/detokenize": _token_op("Token ids to text", "DetokenizeRequest", "Detokenized", secured),
            "/tokenizer_info": {"get": {"summary": "The vocabulary's special tokens and chat template (vLLM's)",
                                        "security": secured,
                                        "responses": json_200("TokenizerInfo", "The tokenizer.") | _errors("401")}},
            "/v1/models": {"get": {"summary": "The served models", "security": secured,
                                   "responses": json_200("ModelList", "The daemon's own chat model, then the "
                                                         "models of [[models]].") | _errors("401")}},
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
