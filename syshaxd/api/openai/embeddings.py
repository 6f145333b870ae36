"""POST /v1/embeddings in OpenAI's shape, answered by the embedding models of [[models]] (engine/embedders.py).

`input` is a string, an array of strings, an array of token ids or an array of those; `encoding_format` "float"
or "base64" (float32 little-endian, as OpenAI's); `dimensions` only as the model's own size, since a model not
trained to be cut shorter (Matryoshka) gives worse vectors when cut. Vectors are scaled to length 1.
"""

from __future__ import annotations

import asyncio
import base64
import json
import uuid

import numpy as np
from aiohttp import web

from syshaxd.api.core.app_keys import MODEL_NAME, SCHEDULER, STATE
from syshaxd.api.core.errors import APIError, invalid
from syshaxd.api.core.generation import read_body
from syshaxd.api.core.model_proxy import ask_keep_alive
from syshaxd.api.core.outputs import client_gone
from syshaxd.api.core.state import Draining
from syshaxd.api.core.validate import type_error, valid_text
from syshaxd.engine import embedders
from syshaxd.engine.embedders import EmbeddingModel
from syshaxd.engine.engine_handle import EngineUnavailable
from syshaxd.sdk.types import Embedded, EmbedRequest, Refusal

routes = web.RouteTableDef()

MAX_INPUTS = 2048  # inputs one request may hold (OpenAI's limit)
FIELDS = ("input", "model", "encoding_format", "dimensions", "user", "keep_alive")
ENCODINGS = ("float", "base64")
_STATUS = {Refusal.INVALID: 400, Refusal.UNAVAILABLE: 503, Refusal.FAILED: 500}
_JSON_OFF_LOOP = 200_000  # numbers in an answer past which it is written off the event loop


def parse_inputs(value) -> tuple[str | tuple[int, ...], ...]:
    """`input` as the engine takes it: texts, or token id arrays; a 400 naming what is wrong."""
    if value is None:
        raise invalid("you must provide 'input': a string, an array of strings, an array of token ids, or an "
                      "array of those", param="input", code="missing_required_parameter")
    if isinstance(value, str):
        items: list = [value]
    elif isinstance(value, list) and value and all(_is_id(v) for v in value):
        items = [value]  # one input of token ids
    elif isinstance(value, list):
        items = value
    else:
        raise type_error("input", "a string or an array", value)
    if not items:
        raise invalid("Invalid 'input': the array is empty; send at least one input.", param="input")
    if len(items) > MAX_INPUTS:
        raise invalid(f"Invalid 'input': at most {MAX_INPUTS} inputs are allowed in one request, got {len(items)}; "
                      "split them over several requests.", param="input")
    inputs: list[str | tuple[int, ...]] = []
    texts = arrays = 0
    for i, item in enumerate(items):
        where = f"input[{i}]" if len(items) > 1 or not isinstance(value, str) else "input"
        if isinstance(item, str):
            if not item:
                raise invalid(f"Invalid '{where}': an input must not be an empty string.", param="input")
            texts += 1
            inputs.append(valid_text(where, item))
        elif isinstance(item, list) and all(_is_id(t) for t in item):
            if not item:
                raise invalid(f"Invalid '{where}': an array of token ids must not be empty.", param="input")
            arrays += 1
            inputs.append(tuple(item))
        else:
            raise type_error(where, "a string or an array of token ids", item)
    if texts and arrays:
        raise invalid("Invalid 'input': an array of inputs holds strings or token id arrays, not both.",
                      param="input")
    return tuple(inputs)


def _is_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def chosen_model(request: web.Request, body: dict, rerank: bool = False) -> EmbeddingModel:
    """The embedding model (or, for /v1/rerank, the reranker) that `model` names; a 400 or 404 that says which
    models this server has for the request."""
    entries = request.app[SCHEDULER].entries
    kind = "rerankers" if rerank else "embedding models"
    served = [m for m in entries.of_kind("embedding") if isinstance(m, EmbeddingModel) and m.file.reranker == rerank]
    names = ", ".join(f"`{m.name}`" for m in served) or "none (add a [[models]] entry)"
    model = body.get("model")
    if model is None:
        raise invalid(f"you must provide a model parameter; this server's {kind}: {names}",
                      param="model", code="missing_required_parameter")
    if not isinstance(model, str):
        raise type_error("model", "a string", model)
    if model == request.app[MODEL_NAME] or (model in entries and entries[model].kind == "chat"):
        what = "score a query and a document together" if rerank else "make one vector of an input"
        raise invalid(f"`{model}` is a chat model: it has no pooling to {what}. Send one of this server's {kind}: "
                      f"{names}.", param="model", code="model_not_supported")
    if model not in entries:
        raise APIError(404, f"The model `{model}` does not exist. This server's {kind}: {names}.",
                       param="model", code="model_not_found")
    chosen = entries[model]
    assert isinstance(chosen, EmbeddingModel)
    if chosen.file.reranker != rerank:
        why = ("is an embedding model: it makes vectors (POST /v1/embeddings), not scores" if rerank else
               "is a reranker: it scores documents against a query (POST /v1/rerank), not texts into vectors")
        raise invalid(f"`{model}` {why}. Send one of this server's {kind}: {names}.", param="model",
                      code="model_not_supported")
    return chosen


def _parse(request: web.Request, body: dict) -> tuple[EmbeddingModel, tuple, str]:
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise invalid(f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0],
                      code="unknown_parameter")
    model = chosen_model(request, body)
    inputs = parse_inputs(body.get("input"))
    encoding = body.get("encoding_format")
    if encoding is None:
        encoding = "float"
    if encoding not in ENCODINGS:
        raise invalid(f"Invalid 'encoding_format': {encoding!r}; it takes \"float\" or \"base64\".",
                      param="encoding_format")
    dimensions = body.get("dimensions")
    if dimensions is not None:
        if not _is_id(dimensions) or dimensions < 1:
            raise invalid("Invalid 'dimensions': expected a positive integer.", param="dimensions")
        if dimensions != model.file.n_embd:
            raise invalid(f"Invalid 'dimensions': `{model.name}` makes vectors of {model.file.n_embd} dimensions and "
                          "is not known to keep its meaning when cut shorter; leave out 'dimensions' or send "
                          f"{model.file.n_embd}.", param="dimensions", code="unsupported_parameter")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise type_error("user", "a string", user)
    ask_keep_alive(model, body)
    return model, inputs, encoding


@routes.post("/v1/embeddings")
async def embeddings(request: web.Request) -> web.Response:
    """Vectors of the inputs from an embedding model of [[models]]."""
    return await counted(request, _answered)


async def counted(request: web.Request, answered) -> web.Response:
    """answered(request) counted as one request in flight (a drain waits for it), or a 503 while draining."""
    try:
        with request.app[STATE].one_request():
            return await answered(request)
    except Draining as exc:
        raise APIError(503, f"syshaxd is draining ({exc}) and takes no new requests; retry shortly or send the "
                       "request to another instance.", type="server_error", code="draining",
                       headers={"Retry-After": "5"}) from None


async def answer_of(request: web.Request, model: EmbeddingModel, embed: EmbedRequest) -> Embedded | None:
    """The model's answer to the request (None: the client left, and its inputs were dropped); the engine's refusal
    as its status (400, 503, 500), the worker's loss or a timeout as a 503."""
    timeout = request.app[STATE].config.request_timeout
    try:
        event = await embedders.embed(request.app[SCHEDULER].entries, model.name, embed, timeout,
                                      lambda: client_gone(request))
    except EngineUnavailable as exc:
        raise APIError(503, str(exc), type="server_error", code="model_unavailable",
                       headers={} if exc.final else {"Retry-After": "5"}) from None
    if event is not None and not isinstance(event, Embedded):
        raise APIError(_STATUS[event.kind], event.message, param=event.param, code=event.code,
                       type="invalid_request_error" if event.kind == Refusal.INVALID else "server_error")
    return event


async def _answered(request: web.Request) -> web.Response:
    body = await read_body(request)
    model, inputs, encoding = _parse(request, body)
    event = await answer_of(request, model, EmbedRequest(f"embd-{uuid.uuid4().hex}", inputs))
    if event is None:  # the client left: nothing to answer, and its inputs were dropped
        return web.Response(status=499, text="client closed the request")
    answer = {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": _encoded(v, encoding)}
                                         for i, v in enumerate(event.vectors)],
              "model": model.name, "usage": {"prompt_tokens": event.n_tokens, "total_tokens": event.n_tokens}}
    numbers = len(event.vectors) * model.file.n_embd
    text = await asyncio.to_thread(json.dumps, answer) if numbers > _JSON_OFF_LOOP else json.dumps(answer)
    return web.Response(text=text, content_type="application/json")


def _encoded(vector: bytes, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(vector).decode("ascii")
    return np.frombuffer(vector, dtype="<f4").tolist()
