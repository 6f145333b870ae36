"""The daemon's service endpoints beside the generation APIs: health, status, metrics, the OpenAPI document."""

from __future__ import annotations

from aiohttp import web

from syshaxd.api.core.app_keys import CONNECTIONS, METRICS, OPENAPI, SCHEDULER, STATE
from syshaxd.api.core.model_proxy import chat_model_metrics
from syshaxd.engine.engine_handle import EngineHandle
from syshaxd.engine.entry_models import Loaded
from syshaxd.engine.lifecycle import HandleState

routes = web.RouteTableDef()


@routes.get("/health")
async def health(request: web.Request) -> web.Response:
    scheduler = request.app[SCHEDULER]
    # the [[models]] entries' workers and daemons too
    handles: list[EngineHandle | Loaded] = [*scheduler.workers, *scheduler.entries.handles]
    workers = [{"name": w.name, "state": w.state, "error": w.error or None} for w in handles]
    state = request.app[STATE]
    if state.draining:  # a load balancer should stop sending here
        return web.json_response({"status": "draining", "reason": state.drain_reason, "mode": scheduler.mode,
                                  "workers": workers}, status=503)
    if scheduler.is_ready():
        return web.json_response({"status": "ok", "mode": scheduler.mode, "workers": workers})
    failed = any(w.state == HandleState.FAILED for w in handles)
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
    # the chat models of [[models]] each count their requests in their own daemon: their series join these
    others = await chat_model_metrics(request.app[SCHEDULER].entries)
    body, content_type = request.app[METRICS].render(request.headers.get("Accept"), others)
    return web.Response(body=body, headers={"Content-Type": content_type})


@routes.get("/openapi.json")
async def openapi(request: web.Request) -> web.Response:
    return web.json_response(request.app[OPENAPI])
