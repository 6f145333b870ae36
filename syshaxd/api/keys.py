"""The typed keys under which the aiohttp application keeps its shared objects."""

from __future__ import annotations

from aiohttp import web

from syshaxd.config import Config
from syshaxd.engine.scheduler import Scheduler

CONFIG = web.AppKey("config", Config)
SCHEDULER = web.AppKey("scheduler", Scheduler)
MODEL_NAME = web.AppKey("model_name", str)
STARTED = web.AppKey("started", float)
