"""The typed keys under which the aiohttp application keeps its shared objects."""

from __future__ import annotations

from aiohttp import web

from syshaxd.api.core.auth import KeyCheck
from syshaxd.api.core.connections import ConnectionCap
from syshaxd.api.core.state import ServiceState
from syshaxd.config import Config
from syshaxd.engine.prompts import DaemonVocab
from syshaxd.engine.scheduler import Scheduler
from syshaxd.metrics import Metrics

CONFIG = web.AppKey("config", Config)
SCHEDULER = web.AppKey("scheduler", Scheduler)
MODEL_NAME = web.AppKey("model_name", str)
STARTED = web.AppKey("started", float)

# CONFIG is the config the app was built with; the live one (SIGHUP, `syshax config set`) is
# STATE's .config, which the scheduler shares.
STATE = web.AppKey("state", ServiceState)
METRICS = web.AppKey("metrics", Metrics)

# the API keys the app checks, the open-connection cap, and the OpenAPI document it serves
KEY_CHECK = web.AppKey("key_check", KeyCheck)
CONNECTIONS = web.AppKey("connections", ConnectionCap)
OPENAPI = web.AppKey("openapi", dict)

# the model's vocabulary in the daemon (tokenize, detokenize, logprobs' token texts), loaded on first use
VOCAB = web.AppKey("vocab", DaemonVocab)
