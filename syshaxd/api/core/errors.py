"""API errors: one exception type that knows its HTTP status and its body, in OpenAI's shape or Anthropic's."""

from __future__ import annotations

from aiohttp import web


class APIError(Exception):
    """Raised anywhere in a handler; the middleware turns it into {"error": {...}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        """Anthropic's shape (/v1/messages): no `param`, so the message names the field ("field: ..." as
        Anthropic writes it, unless the message already quotes it)."""
        kind = ANTHROPIC_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "api_error")
        message = self.message
        if self.param and f"'{self.param}'" not in message:
            message = f"{self.param}: {message}"
        return {"type": "error", "error": {"type": kind, "message": message}}

    def response(self, anthropic: bool = False) -> web.Response:
        body = self.anthropic_body() if anthropic else self.body()
        return web.json_response(body, status=self.status, headers=self.headers)


# Anthropic's error types by status (docs.anthropic.com, "Errors")
ANTHROPIC_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                   413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


def invalid(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def one_of(value, choices, param: str):
    """value, if it is one of choices; else the 400 that names the field and every value it takes."""
    if value not in choices:
        raise invalid(f"Invalid '{param}': {value!r}; it must be one of {', '.join(repr(str(c)) for c in choices)}.",
                      param=param)
    return value


def error_type_for(status: int) -> str:
    return {
        401: "authentication_error",
        403: "permission_error",
        404: "invalid_request_error",
        429: "rate_limit_error",
    }.get(status, "invalid_request_error" if status < 500 else "server_error")
