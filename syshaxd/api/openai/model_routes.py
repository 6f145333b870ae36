"""The models a daemon serves: GET /v1/models (OpenAI's list, each with its state), and llama-server's router
endpoints POST /models/load and /models/unload for the models of [[models]] (the daemon's own chat model always
stays loaded)."""

from __future__ import annotations

from aiohttp import web

from syshaxd.api.core.app_keys import CONFIG, MODEL_NAME, SCHEDULER, STARTED
from syshaxd.api.core.errors import APIError, invalid
from syshaxd.api.core.validate import parse_json_body, type_error
from syshaxd.engine.embedders import EmbeddingModel
from syshaxd.engine.engine_handle import EngineUnavailable
from syshaxd.engine.entry_models import EntryModel

routes = web.RouteTableDef()


def _model_card(request: web.Request) -> dict:
    """The daemon's own chat model: loaded while the daemon runs."""
    return {"id": request.app[MODEL_NAME], "object": "model", "created": int(request.app[STARTED]),
            "owned_by": "syshax", "syshax": {"kind": "chat", "state": "ready" if request.app[SCHEDULER].engines_ready()
                                             else "loading", "load": "start", "mode": request.app[SCHEDULER].mode}}


def _entry_card(request: web.Request, model: EntryModel) -> dict:
    """A model of [[models]]: OpenAI's fields, and what it is and whether it is loaded (and why it failed)."""
    about: dict[str, str | int] = {"kind": model.kind, "state": model.state, "load": model.entry.load}
    if isinstance(model, EmbeddingModel):
        # a reranker gives scores, not vectors: no dimensions to show
        about |= ({} if model.file.reranker else {"dimensions": model.file.n_embd}) | {"pooling": model.file.pooling}
    else:
        about |= {"mode": model.status().mode}
    if model.handle is not None and model.handle.error:
        about["error"] = model.handle.error
    return {"id": model.name, "object": "model", "created": int(request.app[STARTED]), "owned_by": "syshax",
            "syshax": about}


@routes.get("/v1/models")
async def list_models(request: web.Request) -> web.Response:
    entries = request.app[SCHEDULER].entries.models.values()
    return web.json_response({"object": "list", "data": [_model_card(request)]
                              + [_entry_card(request, m) for m in entries]})


@routes.get("/v1/models/{model}")
async def get_model(request: web.Request) -> web.Response:
    name = request.match_info["model"]
    entries = request.app[SCHEDULER].entries
    if name in entries:
        return web.json_response(_entry_card(request, entries[name]))
    if name != request.app[MODEL_NAME]:
        raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")
    return web.json_response(_model_card(request))


async def _named(request: web.Request) -> str:
    """The model of [[models]] a load or unload names ({"model": NAME}, as llama-server's router takes it)."""
    body = parse_json_body(await request.read())
    name = body.get("model")
    if name is None:
        raise invalid("you must provide 'model'", param="model", code="missing_required_parameter")
    if not isinstance(name, str):
        raise type_error("model", "a string", name)
    entries = request.app[SCHEDULER].entries
    if name == request.app[MODEL_NAME]:
        raise invalid(f"`{name}` is the daemon's own model, which stays loaded while the daemon runs; only the "
                      "models of [[models]] load and unload.", param="model", code="model_not_supported")
    if name not in entries:
        names = ", ".join(f"`{n}`" for n in entries.models) or "none"
        raise APIError(404, f"The model `{name}` does not exist. Models that load and unload: {names}.",
                       param="model", code="model_not_found")
    return name


@routes.post("/models/load")
async def load_model(request: web.Request) -> web.Response:
    """Load a model of [[models]] now (it answers once loaded)."""
    name = await _named(request)
    try:
        await request.app[SCHEDULER].entries.load(name, request.app[CONFIG].worker_start_timeout)
    except EngineUnavailable as exc:
        raise APIError(503, str(exc), type="server_error", code="model_unavailable") from None
    return web.json_response({"success": True})


@routes.post("/models/unload")
async def unload_model(request: web.Request) -> web.Response:
    """Unload a model of [[models]] once the requests using it are done, giving its memory back."""
    name = await _named(request)
    await request.app[SCHEDULER].entries[name].unload("asked by POST /models/unload")
    return web.json_response({"success": True})
