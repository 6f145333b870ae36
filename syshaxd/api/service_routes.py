"""The daemon's service endpoints beside the generation APIs: models, health, status, metrics, the OpenAPI document."""

from __future__ import annotations

from aiohttp import web

from syshaxd.api.errors import APIError
from syshaxd.api.keys import CONNECTIONS, METRICS, MODEL_NAME, OPENAPI, SCHEDULER, STARTED, STATE
from syshaxd.engine.embedders import EmbeddingModel
from syshaxd.engine.lifecycle import HandleState

routes = web.RouteTableDef()


def _model_card(request: web.Request) -> dict:
    return {"id": request.app[MODEL_NAME], "object": "model", "created": int(request.app[STARTED]),
            "owned_by": "syshax"}


def _embedding_card(request: web.Request, model: EmbeddingModel) -> dict:
    """An embedding model of [[models]]: OpenAI's fields, and what it is and whether it is loaded."""
    return {"id": model.name, "object": "model", "created": int(request.app[STARTED]), "owned_by": "syshax",
            "syshax": {"kind": "embedding", "state": model.state, "load": model.entry.load,
                       "dimensions": model.file.n_embd, "pooling": model.file.pooling}}


@routes.get("/v1/models")
async def list_models(request: web.Request) -> web.Response:
    embedders = request.app[SCHEDULER].embedders.models.values()
    return web.json_response({"object": "list", "data": [_model_card(request)]
                              + [_embedding_card(request, m) for m in embedders]})


@routes.get("/v1/models/{model}")
async def get_model(request: web.Request) -> web.Response:
    name = request.match_info["model"]
    embedders = request.app[SCHEDULER].embedders
    if name in embedders:
        return web.json_response(_embedding_card(request, embedders[name]))
    if name != request.app[MODEL_NAME]:
        raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")
    return web.json_response(_model_card(request))


@routes.get("/health")
async def health(request: web.Request) -> web.Response:
    scheduler = request.app[SCHEDULER]
    workers = [{"name": w.name, "state": w.state, "error": w.error or None}
               for w in [*scheduler.workers, *scheduler.embedders.handles]]
    state = request.app[STATE]
    if state.draining:  # a load balancer should stop sending here
        return web.json_response({"status": "draining", "reason": state.drain_reason, "mode": scheduler.mode,
                                  "workers": workers}, status=503)
    if scheduler.is_ready():
        return web.json_response({"status": "ok", "mode": scheduler.mode, "workers": workers})
    failed = any(w.state == HandleState.FAILED for w in [*scheduler.workers, *scheduler.embedders.handles])
    return web.json_response({"status": "failed" if failed else "loading", "mode": scheduler.mode,
                              "workers": workers}, status=503)


@routes.get("/v1/syshax/status")
async def status(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response(request.app[SCHEDULER].status().to_json() | {
        "draining": state.draining, "http_active": state.active,
        "http_connections": request.app[CONNECTIONS].stats(),
        "recent": request.app[METRICS].recent.to_json()})


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    body, content_type = request.app[METRICS].render(request.headers.get("Accept"))
    return web.Response(body=body, headers={"Content-Type": content_type})


@routes.get("/openapi.json")
async def openapi(request: web.Request) -> web.Response:
    return web.json_response(request.app[OPENAPI])
