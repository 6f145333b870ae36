"""syshaxd: the daemon's command line, start-up, and orderly shutdown."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from aiohttp import web

from syshaxd import __version__
from syshaxd.api.app import make_app
from syshaxd.config import MODES, Config, ConfigError, load
from syshaxd.engine.scheduler import Scheduler
from syshaxd.engine.supervisor import WorkerHandle
from syshaxd.engine.plan import PlanError, worker_specs
from syshaxd.model import ModelError, resolve_model, served_name

log = logging.getLogger("syshaxd")

SYSTEM_CONFIG = Path("/etc/syshax/syshax.toml")


class StartupError(RuntimeError):
    """The daemon cannot start as configured; the message says what to change."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="syshaxd",
        description="syshax inference daemon: an OpenAI-compatible endpoint over CPU (and later GPU) engines.",
        epilog="Flags override the config file. Without --config, $SYSHAX_CONFIG, then ./etc/syshax.toml, then "
        f"{SYSTEM_CONFIG} are tried; without any, built-in defaults serve the default model on 127.0.0.1:8000.",
    )
    p.add_argument("--config", metavar="PATH", help="TOML config file (see etc/syshax.toml for every key)")
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="TCP port (default 8000; 0 picks a free one)")
    p.add_argument("--mode", choices=MODES, help="where prefill and decode run")
    p.add_argument("--model", metavar="PATH", help="GGUF file to serve (default: the prepared SmolLM2-135M-Instruct)")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
    p.add_argument("--version", action="version", version=f"syshaxd {__version__}")
    return p


def find_config(explicit: str | None) -> Path | None:
    if explicit:
        return Path(explicit)
    for candidate in (os.environ.get("SYSHAX_CONFIG"), "etc/syshax.toml", str(SYSTEM_CONFIG)):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


async def serve(cfg: Config) -> int:
    try:
        model_path = resolve_model(cfg.model, cfg.model_dir_path())
    except ModelError as exc:
        raise StartupError(str(exc)) from None
    model_name = served_name(cfg.model_name, model_path)
    try:
        specs = worker_specs(cfg, model_path, model_name, dict(os.environ))
    except PlanError as exc:
        raise StartupError(str(exc)) from None

    workers = [WorkerHandle(f"cpu{i}", spec, cfg.log_level, cfg.worker_restart_delay) for i, spec in enumerate(specs)]
    scheduler = Scheduler(cfg, workers)
    app = make_app(cfg, scheduler, model_name)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise StartupError(f"cannot listen on {cfg.host}:{cfg.port}: {exc.strerror}; choose another --port") from None
    host, port = runner.addresses[0][:2]
    log.info("syshaxd %s listening on http://%s:%d (mode %s); loading %s", __version__, host, port, cfg.mode,
             model_path.name)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    for w in workers:
        w.start()
    ready = asyncio.ensure_future(asyncio.wait_for(asyncio.gather(*(w.ready.wait() for w in workers)),
                                                   cfg.worker_start_timeout))
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({ready, stopped}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if ready.done() and not ready.cancelled() and ready.exception() is None:
        log.info("ready: serving %s on http://%s:%d/v1 -- try: curl http://%s:%d/v1/completions "
                 "-H 'Content-Type: application/json' -d '{\"model\": \"%s\", \"prompt\": \"Hello\", "
                 "\"max_tokens\": 32}'", model_name, host, port, host, port, model_name)
        print(f"syshaxd ready on http://{host}:{port}", flush=True)
        await stopped
    elif not stopped.done():
        failed = [f"{w.name}: {w.error or w.state}" for w in workers if w.state != "ready"]
        log.error("engines did not become ready (%s); the daemon keeps answering /health with 503",
                  "; ".join(failed) or "timeout")
        await stopped
    ready.cancel()

    log.info("shutting down")
    await site.stop()
    await runner.cleanup()
    await asyncio.gather(*(w.stop() for w in workers))
    log.info("stopped")
    return code


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    overrides = {"host": args.host, "port": args.port, "mode": args.mode, "model": args.model,
                 "log_level": args.log_level, "quantize": os.environ.get("SYSHAX_QUANTIZE")}
    try:
        cfg = load(find_config(args.config), overrides)
    except ConfigError as exc:
        print(f"syshaxd: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=getattr(logging, cfg.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        import uvloop

        return uvloop.run(serve(cfg))
    except StartupError as exc:
        print(f"syshaxd: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
