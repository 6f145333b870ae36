"""POST /v1/rerank (and /rerank): documents scored against a query by a reranker of [[models]], in the shape
llama-server, Jina and Cohere answer: `results` sorted by `relevance_score`, best first, each with the document's
`index` in the request (and its text with `return_documents`), cut to `top_n`.

A reranker is an entry whose GGUF pools as "rank" (Qwen3-Reranker, as llama.cpp's converter writes it). Each
document is one input of the model's worker, written beside the query as llama-server writes it
(syshax_llamacpp/embedding.py, _pair_tokens); its score is the model's first output (Qwen3-Reranker's P(yes)).
"""

from __future__ import annotations

import uuid

import numpy as np
from aiohttp import web

from syshaxd.api.core.errors import invalid
from syshaxd.api.core.generation import read_body
from syshaxd.api.core.model_proxy import ask_keep_alive
from syshaxd.api.core.validate import type_error, valid_text
from syshaxd.api.openai.embeddings import MAX_INPUTS, answer_of, chosen_model, counted
from syshaxd.engine.embedders import EmbeddingModel
from syshaxd.sdk.types import EmbedRequest

routes = web.RouteTableDef()

FIELDS = ("model", "query", "documents", "top_n", "return_documents", "keep_alive")


def _parse(request: web.Request, body: dict) -> tuple[EmbeddingModel, str, tuple[str, ...], int, bool]:
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise invalid(f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0],
                      code="unknown_parameter")
    model = chosen_model(request, body, rerank=True)
    query = body.get("query")
    if query is None:
        raise invalid("you must provide 'query': the text the documents are scored against", param="query",
                      code="missing_required_parameter")
    _one_text(query, "query", "query")
    documents = body.get("documents")
    if documents is None:
        raise invalid("you must provide 'documents': an array of the texts to score", param="documents",
                      code="missing_required_parameter")
    if not isinstance(documents, list):
        raise type_error("documents", "an array of strings", documents)
    if not documents:
        raise invalid("Invalid 'documents': the array is empty; send at least one document.", param="documents")
    if len(documents) > MAX_INPUTS:
        raise invalid(f"Invalid 'documents': at most {MAX_INPUTS} documents are allowed in one request, got "
                      f"{len(documents)}; split them over several requests.", param="documents")
    for i, document in enumerate(documents):
        _one_text(document, f"documents[{i}]", "documents")
    top_n = body.get("top_n")
    if top_n is None:
        top_n = len(documents)
    elif not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 1:
        raise invalid(f"Invalid 'top_n': {top_n!r}; expected a positive integer (the best documents to return).",
                      param="top_n")
    return_documents = body.get("return_documents", False)
    if not isinstance(return_documents, bool):
        raise type_error("return_documents", "a boolean", return_documents)
    ask_keep_alive(model, body)
    return model, query, tuple(documents), top_n, return_documents


def _one_text(value, where: str, param: str) -> None:
    """The query or a document: a non-empty string of valid Unicode, else a 400 that names it."""
    if not isinstance(value, str):
        raise type_error(where, "a string", value)
    if not value:
        what = "a document" if param == "documents" else "it"
        raise invalid(f"Invalid '{where}': {what} must not be an empty string.", param=param)
    valid_text(where, value)


@routes.post("/rerank")  # llama-server's other path
@routes.post("/v1/rerank")
async def rerank(request: web.Request) -> web.Response:
    """Documents scored against a query by a reranker of [[models]], best first."""
    return await counted(request, _answered)


async def _answered(request: web.Request) -> web.Response:
    body = await read_body(request)
    model, query, documents, top_n, return_documents = _parse(request, body)
    event = await answer_of(request, model, EmbedRequest(f"rerank-{uuid.uuid4().hex}", documents, query=query))
    if event is None:  # the client left: nothing to answer, and its documents were dropped
        return web.Response(status=499, text="client closed the request")
    scores = [float(np.frombuffer(v, dtype="<f4")[0]) for v in event.vectors]
    order = sorted(range(len(documents)), key=lambda i: -scores[i])[:top_n]  # stable: ties keep request order
    results = [{"index": i, "relevance_score": scores[i]} | ({"document": {"text": documents[i]}}
                                                             if return_documents else {}) for i in order]
    return web.json_response({"id": f"rerank-{uuid.uuid4().hex}", "object": "list", "model": model.name,
                              "results": results,
                              "usage": {"prompt_tokens": event.n_tokens, "total_tokens": event.n_tokens}})
