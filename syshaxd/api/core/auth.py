"""API keys: who may call /v1/*; keys from api_keys and api_key_file, checked in constant time.

When at least one key is configured, every request under /v1/ (and /metrics when
metrics_require_key is true) must carry ``Authorization: Bearer <key>`` (or ``X-Api-Key: <key>``,
which Anthropic's SDK sends); anything
else gets 401 in OpenAI's shape with ``WWW-Authenticate: Bearer``. /health stays
open for systemd and Kubernetes probes, and /openapi.json for API tooling.

A key is never logged nor put in an error message. The presented token is hashed
and compared with ``hmac.compare_digest`` against every key's hash (no early exit),
so neither a key's content nor its length shows in the answer time.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for annotations only: this module imports without aiohttp
    from aiohttp import web

    from syshaxd.api.core.errors import APIError
    from syshaxd.config import Config

def key_file_path(cfg: "Config") -> str:
    """api_key_file with $VARIABLES and ~ expanded ("" when unset)."""
    return os.path.expanduser(os.path.expandvars(cfg.api_key_file)) if cfg.api_key_file else ""


def configured_keys(cfg: "Config") -> tuple[str, ...]:
    """Every key from api_keys and api_key_file, which is read now; raises ConfigError (naming the key, never a value).

    The daemon calls this once at start (and again on SIGHUP, to refuse a reload whose file it cannot read);
    config validation does not, so changing a key on the running daemon never touches the disk.
    """
    from syshaxd.config import ConfigError, check_api_key

    for i, key in enumerate(cfg.api_keys):
        check_api_key(key, f"api_keys[{i}]")
    keys = list(cfg.api_keys)
    path = key_file_path(cfg)
    if path:
        if "$" in path:
            raise ConfigError(f"api_key_file: {cfg.api_key_file!r} names an environment variable that is not set "
                              "(under systemd, LoadCredential= sets $CREDENTIALS_DIRECTORY)")
        try:
            with open(path, encoding="utf-8") as fh:
                lines = fh.read().splitlines()
        except OSError as exc:
            raise ConfigError(f"api_key_file: cannot read {path}: {exc.strerror or exc}; the daemon's user must be "
                              "able to read it (or unset api_key_file)") from None
        except UnicodeDecodeError:
            raise ConfigError(f"api_key_file: {path} is not UTF-8 text; write one key per line") from None
        from_file = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not from_file:  # fail closed: an empty credential must not silently open the API
            raise ConfigError(f"api_key_file: {path} holds no key; write one key per line (lines starting with "
                              "# are comments), or unset api_key_file to run without keys")
        for n, key in enumerate(from_file, 1):
            check_api_key(key, f"api_key_file ({path}, key {n})")
        keys += from_file
    return tuple(dict.fromkeys(keys))


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


# the paths outside /v1/ that need a key too: the token endpoints, and loading and unloading models
KEYED_PATHS = frozenset({"/tokenize", "/detokenize", "/tokenizer_info", "/models/load", "/models/unload", "/rerank"})


class KeyCheck:
    """The keys of one configuration, ready for constant-time checks."""

    def __init__(self, keys: tuple[str, ...], metrics_require_key: bool) -> None:
        self._digests = [_digest(k) for k in keys]
        self.metrics_require_key = metrics_require_key

    @classmethod
    def from_config(cls, cfg: "Config") -> "KeyCheck":
        return cls(configured_keys(cfg), cfg.metrics_require_key)

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def protects(self, path: str) -> bool:
        if not self._digests:
            return False
        return (path == "/v1" or path.startswith("/v1/") or path in KEYED_PATHS
                or (self.metrics_require_key and path == "/metrics"))

    def accepts(self, token: str) -> bool:
        given = _digest(token)
        ok = False
        for digest in self._digests:  # every key, always: the time does not depend on which one matched
            ok |= hmac.compare_digest(given, digest)
        return ok

    def check(self, request: "web.Request") -> None:
        """Raise the 401 APIError unless the request carries a valid Bearer key (or, as Anthropic's clients send
        it, an X-Api-Key header)."""
        header = request.headers.get("Authorization", "")
        if not header and "X-Api-Key" in request.headers:
            if not self.accepts(request.headers["X-Api-Key"].strip()):
                raise _unauthorized("Incorrect API key provided in X-Api-Key (keys are set by api_keys / api_key_file "
                                    "in the daemon's config).", 'Bearer realm="syshaxd", error="invalid_token"')
            return
        scheme, _, token = header.partition(" ")
        token = token.strip()
        if not header:
            raise _unauthorized("You didn't provide an API key. Send it in the Authorization header as "
                                "'Authorization: Bearer YOUR_KEY' (ask the operator of this syshaxd for one).",
                                'Bearer realm="syshaxd"')
        if scheme.lower() != "bearer" or not token:
            raise _unauthorized("The Authorization header must be 'Bearer YOUR_KEY'; no other scheme is accepted.",
                                'Bearer realm="syshaxd", error="invalid_request"')
        if not self.accepts(token):
            raise _unauthorized("Incorrect API key provided. Check the key you send as 'Authorization: Bearer "
                                "YOUR_KEY' (keys are set by api_keys / api_key_file in the daemon's config).",
                                'Bearer realm="syshaxd", error="invalid_token"')


def _unauthorized(message: str, challenge: str) -> "APIError":
    from syshaxd.api.core.errors import APIError

    return APIError(401, message, type="authentication_error", code="invalid_api_key",
                    headers={"WWW-Authenticate": challenge})
