"""Builds the aiohttp application: routes, shared objects, API keys, errors in OpenAI's shape, request counting."""

from __future__ import annotations

import logging
import time

from aiohttp import web

from syshaxd.api import messages, responses, service_routes
from syshaxd.api.core import model_proxy, sse
from syshaxd.api.core.app_keys import (CONFIG, CONNECTIONS, KEY_CHECK, METRICS, MODEL_NAME, OPENAPI, SCHEDULER, STARTED,
                                       STATE, VOCAB)
from syshaxd.api.core.auth import KeyCheck
from syshaxd.api.core.connections import ConnectionCap
from syshaxd.api.core.errors import APIError, error_type_for
from syshaxd.api.core.state import ServiceState
from syshaxd.api.openai import embeddings, model_routes, rerank, token_routes
from syshaxd.api.openai import routes as openai_routes
from syshaxd.api.openapi import build_document
from syshaxd.api.web import routes as web_routes
from syshaxd.config import Config
from syshaxd.engine.scheduler import Scheduler
from syshaxd.metrics import Metrics

log = logging.getLogger(__name__)


@web.middleware
async def count_requests(request: web.Request, handler):
    """Count every answer by route pattern (not raw path: unknown paths must not grow the label set)."""
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as exc:
        status = exc.status
        raise
    finally:
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"
        request.app[METRICS].count_http(route, request.method, status)


@web.middleware
async def openai_errors(request: web.Request, handler):
    """Every error leaves as {"error": {...}} (Anthropic's shape under /v1/messages); nothing a client sends takes
    the daemon down."""
    anthropic = request.path == "/v1/messages" or request.path.startswith("/v1/messages/")
    try:
        return await handler(request)
    except APIError as exc:
        return exc.response(anthropic)
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[CONFIG].max_body_bytes
        return APIError(413, f"The request body is too large; the limit is {limit} bytes (max_body_bytes).",
                        code="request_too_large").response(anthropic)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        msg = {404: f"Unknown path {request.path}; see /v1/models, /v1/chat/completions, /v1/completions, "
                    "/v1/responses, /v1/messages.",
               405: f"Method {request.method} is not allowed on {request.path}."}.get(exc.status, exc.reason)
        return APIError(exc.status, msg, type=error_type_for(exc.status), code=exc.reason.lower().replace(" ", "_"),
                        headers={k: v for k, v in exc.headers.items() if k == "Allow"}).response(anthropic)
    except Exception:
        log.exception("unhandled error serving %s %s", request.method, request.path)
        return APIError(500, "The server had an error while processing your request; it has been logged.",
                        type="server_error", code="internal_error").response(anthropic)


@web.middleware
async def require_api_key(request: web.Request, handler):
    """With API keys configured, /v1/* (and /metrics if so configured) needs one; /health never does."""
    keys = request.app[KEY_CHECK]
    if keys.protects(request.path):
        keys.check(request)  # raises the 401 APIError, which openai_errors answers
    return await handler(request)


def make_app(config: Config, scheduler: Scheduler, model_name: str, state: ServiceState | None = None,
             metrics: Metrics | None = None, *, keys: KeyCheck) -> web.Application:
    """The application; `keys` were read once when the daemon started: they change with a restart."""
    state = state or ServiceState(scheduler)
    # a request for a chat model of [[models]] is passed on (model_proxy) once its key has been checked
    app = web.Application(middlewares=[count_requests, openai_errors, require_api_key,
                                       model_proxy.forward_to_chat_model],
                          client_max_size=config.max_body_bytes)
    app[KEY_CHECK] = keys
    # bound to the server by api.core.connections.CappedTCPSite; the live client_timeout bounds a silent new connection
    # and a request head that trickles in
    app[CONNECTIONS] = ConnectionCap(config.max_connections, lambda: state.config.client_timeout)
    app[OPENAPI] = build_document(model_name, config.n_ctx,
                                  [m for m, why in scheduler.servable_modes().items() if not why],
                                  app[KEY_CHECK].enabled, config.metrics_require_key)
    app[CONFIG] = config
    app[SCHEDULER] = scheduler
    app[MODEL_NAME] = model_name
    app[STARTED] = time.time()
    app[STATE] = state
    app[METRICS] = metrics or Metrics(model_name, scheduler.status,
                                      lambda: {"draining": state.draining, "active": state.active})
    app[VOCAB] = scheduler.vocab
    app[sse.PASS_WRITES] = sse.PassWrites()
    app.add_routes(openai_routes.routes)
    app.add_routes(service_routes.routes)
    app.add_routes(model_routes.routes)
    app.add_routes(token_routes.routes)
    app.add_routes(embeddings.routes)
    app.add_routes(rerank.routes)
    app.add_routes(responses.routes)
    app.add_routes(messages.routes)
    if config.web_ui:
        app.add_routes(web_routes.routes)
    return app
