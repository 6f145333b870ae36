"""The OpenAPI schemas of the requests and answers of the models of [[models]] that answer outside the generation
APIs: /v1/embeddings (OpenAI's shape), /v1/rerank (llama-server's, Jina's and Cohere's), and the router's
/models/load and /models/unload (api/openapi.py puts them in the document).
"""

from __future__ import annotations


def nullable(schema: dict) -> dict:
    """The schema, or null: validate.py treats a null field as an absent one."""
    return {"anyOf": [schema, {"type": "null"}]}


def vector_schemas() -> dict:
    """/v1/embeddings: OpenAI's request and answer; /v1/rerank: llama-server's (Jina's and Cohere's)."""
    ids = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
    text = {"type": "string", "minLength": 1}
    return {
        "EmbeddingRequest": {
            "type": "object", "required": ["input", "model"], "additionalProperties": False,
            "properties": {
                "input": {"description": "A string, an array of strings, an array of token ids, or an array of "
                                         "those: at most 2048 inputs, each within the model's n_ctx.",
                          "anyOf": [text, {"type": "array", "items": text, "minItems": 1, "maxItems": 2048}, ids,
                                    {"type": "array", "items": ids, "minItems": 1, "maxItems": 2048}]},
                "model": {"type": "string", "description": "An embedding model of [[models]] (GET /v1/models)."},
                "encoding_format": nullable({"type": "string", "enum": ["float", "base64"],
                                              "description": "base64: the float32 little-endian bytes."}),
                "dimensions": nullable({"type": "integer", "minimum": 1,
                                         "description": "Only the model's own size."}),
                "user": nullable({"type": "string"}),
                "keep_alive": nullable({"anyOf": [{"type": "number"}, {"type": "string"}], "description":
                                         "Ollama's: seconds the model stays loaded after it, or \"5m\" (-1 never)"})}},
        "RerankRequest": {
            "type": "object", "required": ["model", "query", "documents"], "additionalProperties": False,
            "properties": {
                "model": {"type": "string", "description": "A reranker of [[models]] (GET /v1/models)."},
                "query": {"type": "string", "minLength": 1},
                "documents": {"type": "array", "items": text, "minItems": 1, "maxItems": 2048,
                              "description": "The texts to score, each within the model's n_ctx beside the query."},
                "top_n": nullable({"type": "integer", "minimum": 1,
                                    "description": "The best documents to return (all by default)."}),
                "return_documents": {"type": "boolean", "description": "Each result with its document's text."},
                "keep_alive": nullable({"anyOf": [{"type": "number"}, {"type": "string"}], "description":
                                         "Ollama's: seconds the model stays loaded after it, or \"5m\" (-1 never)"})}},
        "RerankList": {
            "type": "object", "required": ["object", "model", "results", "usage"],
            "properties": {
                "id": {"type": "string"}, "object": {"const": "list"}, "model": {"type": "string"},
                "results": {"type": "array", "items": {
                    "type": "object", "required": ["index", "relevance_score"],
                    "properties": {"index": {"type": "integer"}, "relevance_score": {"type": "number"},
                                   "document": {"type": "object", "properties": {"text": {"type": "string"}}}}}},
                "usage": {"type": "object", "required": ["prompt_tokens", "total_tokens"], "properties": {
                    "prompt_tokens": {"type": "integer"}, "total_tokens": {"type": "integer"}}}}},
        "ModelName": {"type": "object", "required": ["model"], "additionalProperties": True,
                      "properties": {"model": {"type": "string", "description": "A model of [[models]]."}}},
        "Success": {"type": "object", "required": ["success"], "properties": {"success": {"const": True}}},
        "EmbeddingList": {
            "type": "object", "required": ["object", "data", "model", "usage"],
            "properties": {
                "object": {"const": "list"}, "model": {"type": "string"},
                "data": {"type": "array", "items": {
                    "type": "object", "required": ["object", "index", "embedding"],
                    "properties": {"object": {"const": "embedding"}, "index": {"type": "integer"}, "embedding": {
                        "anyOf": [{"type": "array", "items": {"type": "number"}}, {"type": "string"}]}}}},
                "usage": {"type": "object", "required": ["prompt_tokens", "total_tokens"], "properties": {
                    "prompt_tokens": {"type": "integer"}, "total_tokens": {"type": "integer"}}}}},
    }
