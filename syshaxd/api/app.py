"""Builds the aiohttp application: routes, shared objects, and errors in OpenAI's shape."""

from __future__ import annotations

import logging
import time

from aiohttp import web

from syshaxd.api import openai_routes
from syshaxd.api.errors import APIError, error_type_for
from syshaxd.api.keys import CONFIG, MODEL_NAME, SCHEDULER, STARTED
from syshaxd.config import Config
from syshaxd.engine.scheduler import Scheduler

log = logging.getLogger(__name__)


@web.middleware
async def openai_errors(request: web.Request, handler):
    """Every error leaves as {"error": {...}}; nothing a client sends takes the daemon down."""
    try:
        return await handler(request)
    except APIError as exc:
        return exc.response()
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[CONFIG].max_body_bytes
        return APIError(413, f"The request body is too large; the limit is {limit} bytes (max_body_bytes).",
                        code="request_too_large").response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        msg = {404: f"Unknown path {request.path}; see /v1/models, /v1/completions, /v1/chat/completions.",
               405: f"Method {request.method} is not allowed on {request.path}."}.get(exc.status, exc.reason)
        return APIError(exc.status, msg, type=error_type_for(exc.status), code=exc.reason.lower().replace(" ", "_"),
                        headers={k: v for k, v in exc.headers.items() if k == "Allow"}).response()
    except Exception:
        log.exception("unhandled error serving %s %s", request.method, request.path)
        return APIError(500, "The server had an error while processing your request; it has been logged.",
                        type="server_error", code="internal_error").response()


def make_app(config: Config, scheduler: Scheduler, model_name: str) -> web.Application:
    app = web.Application(middlewares=[openai_errors], client_max_size=config.max_body_bytes)
    app[CONFIG] = config
    app[SCHEDULER] = scheduler
    app[MODEL_NAME] = model_name
    app[STARTED] = time.time()
    app.add_routes(openai_routes.routes)
    return app
