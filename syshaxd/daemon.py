"""syshaxd: the daemon's command line, start-up (systemd notify), signals (drain, reload), shutdown."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web

from syshaxd import __version__
from syshaxd.api.admin.unix_socket import AdminServer, default_path
from syshaxd.api.app import make_app
from syshaxd.api.core.app_keys import CONNECTIONS
from syshaxd.api.core.auth import KeyCheck, configured_keys
from syshaxd.api.core.connections import CappedTCPSite
from syshaxd.api.core.state import ServiceState
from syshaxd.config import MODES, SYSTEM_CONFIG, Config, ConfigError, find_config, flat_keys_warning, load
from syshaxd.engine.embedders import bind_workers
from syshaxd.engine.engine_handle import EngineHandle
from syshaxd.engine.entry_models import EntryModels, Loaded, ModelsError
from syshaxd.engine.entry_plan import plan_entries
from syshaxd.engine.kv_ledger import KVLedger
from syshaxd.engine.lifecycle import HandleState
from syshaxd.engine.plan import Engines, PlanError, plan_engines
from syshaxd.engine.prefix_cache import PrefixCache
from syshaxd.engine.prefix_disk import DiskTier
from syshaxd.engine.prompts import DaemonVocab, PromptTokenizer
from syshaxd.engine.scheduler import Scheduler
from syshaxd.engine.supervisor import WorkerHandle
from syshaxd.environment import hook_warnings
from syshaxd.model import ModelError, resolve_model, served_name
from syshaxd.notify import Notifier
from syshaxd.routing_rules import RuleError, check_served
from syshaxd.sdk.gguf.header import GGUFError
from syshaxd.sdk.gguf.quantize import load_plan
from syshaxd.sdk.kv.ring import KVRing
from syshaxd.startup import StartupError, create_disk_tier, create_ring, create_store

if TYPE_CHECKING:
    from syshaxd.remote.front import RemoteNode

log = logging.getLogger("syshaxd")

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
    p.add_argument("--models-dir", metavar="DIR",
                   help="serve every GGUF in DIR by its file name, loaded on demand (models_dir)")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"),
                   help="how much the daemon logs (log_level; default info)")
    p.add_argument("--node", metavar="HOST:PORT",
                   help="run as a decode node for a front daemon on another host, listening at HOST:PORT "
                   "(node_listen; the front lists it in remote_nodes; both need node_secret_file)")
    p.add_argument("--version", action="version", version=f"syshaxd {__version__}")
    return p


def load_checked(path: Path | None, overrides: dict) -> Config:
    """load(), and a ConfigError too when api_key_file cannot be read (the keys themselves apply at a restart)."""
    cfg = load(path, overrides)
    configured_keys(cfg)
    return cfg


async def serve(cfg: Config, keys: KeyCheck, notifier: Notifier | None = None,
                reload: Callable[[], Config] | None = None) -> int:
    """Run the daemon until it is stopped; `keys`: the API keys, read once at start."""
    notifier = notifier or Notifier(None)
    notifier.status(f"preparing {cfg.model or 'the default model'}")
    try:
        model_path = resolve_model(cfg.model, cfg.model_dir_path())
    except ModelError as exc:
        raise StartupError(str(exc)) from None
    try:
        model_file = load_plan(model_path, cfg.quantize)
    except GGUFError as exc:
        raise StartupError(f"model: {exc}; pass --model PATH to a GGUF file (llama.cpp's model format)") from None
    log.info("model %s: %s", model_path.name, model_file.why)
    model_name = served_name(cfg.model_name, model_path)
    try:  # the models of [[models]]: embedding models' workers are made by the service, chat models' daemons too
        entries = plan_entries(cfg, model_name, model_path, dict(os.environ))
    except ModelsError as exc:
        raise StartupError(str(exc)) from None
    try:  # a rule on a model not served here could never match
        check_served(cfg.routing_rules, model_name, tuple(m.name for m in entries.of_kind("chat")))
    except RuleError as exc:
        raise StartupError(str(exc)) from None
    try:
        engines = plan_engines(cfg, model_path, model_name, dict(os.environ))
    except PlanError as exc:
        raise StartupError(str(exc)) from None
    ring = create_ring(engines.ring) if engines.ring is not None else None
    store = create_store(engines.prefix) if engines.prefix is not None else None
    disk = (create_disk_tier(cfg, engines.prefix, store, model_path, dict(os.environ))
            if engines.prefix is not None and store is not None else None)
    try:
        service = Service(cfg, engines, ring, model_path, model_name, notifier, reload, keys, disk, entries)
        service.scheduler.model_file = model_file.to_json()
        return await service.run()
    finally:
        if disk is not None:
            disk.close()  # what is queued is written before the block store goes
        for segment in (ring, store):  # the shared-memory segments go with the daemon
            if segment is not None:
                segment.unlink()
                segment.close()


def _remote_nodes(cfg: Config, ring: KVRing | None, ledger: KVLedger, model_path: Path,
                  model_name: str) -> list[RemoteNode]:
    """The front's decode nodes on other hosts (remote_nodes), each one more CPU decoder; none when unset."""
    if not cfg.remote_nodes:
        return []
    from syshaxd.remote.front import FrontTransfer, RemoteNode
    import ssl

    from syshaxd.remote.wire import read_secret, tls_context
    from syshaxd.sdk.gguf.header import fingerprint_from_gguf
    from syshaxd.sdk.types import EngineSpec, Role

    try:
        secret = read_secret(cfg.node_secret_file)
    except (OSError, ValueError) as exc:
        raise StartupError(f"node_secret_file: {exc}") from None
    try:
        tls = tls_context(False, cfg.node_tls_cert, cfg.node_tls_key, cfg.node_tls_ca)
    except (OSError, ssl.SSLError) as exc:
        raise StartupError(f"node_tls_cert, node_tls_key, node_tls_ca: {exc}") from None
    try:
        fingerprint = fingerprint_from_gguf(model_path).to_bytes()
    except (GGUFError, OSError) as exc:
        raise StartupError(f"remote_nodes: cannot fingerprint {model_path.name} for its nodes: {exc}") from None
    transfer = FrontTransfer(ring, cfg.node_transfer_protocol, cfg.node_transfer_device)
    spec = EngineSpec(backend=cfg.cpu_engine, role=Role.GENERATE, model_path=str(model_path), model_name=model_name,
                      n_ctx=cfg.n_ctx, max_batch_size=cfg.cpu_max_batch_size, ring=ring.path.name if ring else "",
                      tiled_attention=cfg.tiled_attention)
    return [RemoteNode(address, secret, spec, ledger, fingerprint, transfer, cfg.node_link_timeout, ssl=tls)
            for address in cfg.remote_nodes]


class Service:
    """One running daemon: the HTTP site, the admin socket, the engine workers, and what signals do to them.

    SIGTERM/SIGINT drain (no new requests, accepted ones finish up to drain_timeout), then stop;
    a second one stops at once. SIGHUP re-reads the config file and applies the live keys.
    """

    def __init__(self, cfg: Config, engines: Engines, ring: KVRing | None, model_path: Path, model_name: str,
                 notifier: Notifier, reload: Callable[[], Config] | None, keys: KeyCheck,
                 disk: DiskTier | None = None, entries: EntryModels | None = None) -> None:
        self.cfg = cfg
        self.model_path = model_path
        self.model_name = model_name
        self.notifier = notifier
        prefix = engines.prefix
        # the one owner of the ring's records and the prefix cache's blocks: every worker reports to it
        ledger = KVLedger(ring, prefix=PrefixCache(prefix.n_slots, prefix.block_tokens, prefix.slot_bytes,
                                                   chunk_tokens=prefix.chunk_tokens, n_wide=prefix.n_wide,
                                                   wide_bytes=prefix.wide_bytes, keep_tokens=prefix.keep_tokens)
                          if prefix is not None else None)
        if ledger.prefix is not None:
            ledger.prefix.disk = disk  # opened when the first engine reports its kernels (the ledger's EngineReady)
        self.workers: list[EngineHandle] = [WorkerHandle(name, spec, cfg.log_level, cfg.worker_restart_delay, cfg.worker_heartbeat_timeout,
                                     ledger, on_failed=self._worker_failed) for name, spec in engines.workers]
        self.workers += _remote_nodes(cfg, ring, ledger, model_path, model_name)
        # prompts are tokenized once, in the daemon, as the engines would (and the prefix cache planned from them)
        self.scheduler = Scheduler(cfg, self.workers, ledger, PromptTokenizer(DaemonVocab(str(model_path)), cfg.n_ctx))
        self.entries = entries or EntryModels([])
        bind_workers(self.entries, lambda name, spec: WorkerHandle(
            name, spec, cfg.log_level, cfg.worker_restart_delay, cfg.worker_heartbeat_timeout,
            on_failed=self._worker_failed))
        self.scheduler.entries = self.entries  # the status and /health show them beside the workers
        self.state = ServiceState(self.scheduler, reload)
        self.app = make_app(cfg, self.scheduler, model_name, self.state, keys=keys)
        self.url = ""
        self.admin: AdminServer | None = None
        self._stop = asyncio.Event()
        self._hurry = asyncio.Event()
        self._ready_sent = False  # READY=1 went out; a reload is bracketed by RELOADING=1 ... READY=1
        self._tasks: set[asyncio.Task] = set()

    async def run(self) -> int:
        # shutdown_timeout: our drain already waited for the requests; what is left after it is cut off
        runner = web.AppRunner(self.app, access_log=None, handle_signals=False, shutdown_timeout=2.0)
        await runner.setup()
        site = CappedTCPSite(runner, self.cfg.host, self.cfg.port, self.app[CONNECTIONS])  # max_connections at most
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            raise StartupError(f"cannot listen on {self.cfg.host}:{self.cfg.port}: {exc.strerror}; "
                               "choose another --port") from None
        host, port = runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        log.info("syshaxd %s listening on %s (mode %s); loading %s", __version__, self.url, self.cfg.mode,
                 self.model_path.name)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_stop_signal, sig)
        loop.add_signal_handler(signal.SIGHUP, lambda: self._spawn(self._reload()))
        interval = self.notifier.watchdog_interval()
        if interval:
            self._spawn(self._watchdog(interval))
        await self._start_admin()
        try:
            await self._load()
            await self._stop.wait()
            await self._drain()
        finally:
            self.notifier.status("stopping engine workers")
            if self.admin is not None:
                await self.admin.close()
            await site.stop()
            await runner.cleanup()
            await asyncio.gather(*(w.stop() for w in self.workers), self.entries.stop())
            for task in self._tasks:
                task.cancel()
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)
            log.info("stopped")
        return 0

    # --- start-up ---------------------------------------------------------------------------

    async def _start_admin(self) -> None:
        path = default_path(self.cfg, os.environ)
        admin = AdminServer(path, self.state, model_name=self.model_name, listen_url=self.url)
        why_not = await admin.start()
        if why_not:
            log.error("admin socket: %s", why_not)
        else:
            self.admin = admin

    def _loading_line(self) -> str:
        line = f"loading {self.model_name}: " + ", ".join(f"{w.name} {w.state}" for w in self.workers)
        entries = self.entries.loading_line()
        return f"{line}; [[models]]: {entries}" if entries else line

    async def _load(self) -> None:
        """Start the workers, report progress as STATUS lines, and READY=1 once all are loaded (or given up on)."""
        timeout = self.cfg.worker_start_timeout
        self.notifier.extend_timeout(timeout + 30)  # a first start may quantize the model
        for w in self.workers:
            w.start()
        self.entries.start()
        if self.entries.models:
            self._spawn(self.entries.unload_idle())  # keep_alive
            self._spawn(self.entries.keep_started(self.cfg.worker_start_timeout))  # load = "start" stays up
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        shown = ""
        while not self._stop.is_set():
            line = self._loading_line()
            if line != shown:
                self.notifier.status(line)
                shown = line
            if self.scheduler.is_ready() and all(w.state == HandleState.READY for w in self.workers):
                break
            # a remote node still loading is waited for; one that cannot be reached is dialled on in the background
            handles: list[EngineHandle | Loaded] = [*self.workers, *self.entries.handles]
            settled = all(w.state in (HandleState.READY, HandleState.FAILED) for w in handles if not w.remote) \
                and not any(w.state in (HandleState.CONNECTING, HandleState.LOADING) for w in self.workers if w.remote)
            if settled or loop.time() >= deadline:
                break
            try:
                await asyncio.wait_for(self._stop.wait(), 0.25)
            except asyncio.TimeoutError:
                pass
        if self._stop.is_set():
            return
        if self.scheduler.is_ready():
            log.info("ready: serving %s on %s/v1 -- try: curl %s/v1/completions -H 'Content-Type: application/json' "
                     "-d '{\"model\": \"%s\", \"prompt\": \"Hello\", \"max_tokens\": 32}'",
                     self.model_name, self.url, self.url, self.model_name)
            print(f"syshaxd ready on {self.url}", flush=True)
            self.notifier.ready(self._serving_line())
            self._ready_sent = True
        else:
            handles = [*self.workers, *self.entries.handles]
            failed = "; ".join(f"{w.name}: {w.error or w.state}" for w in handles
                               if w.state != HandleState.READY)
            log.error("engines did not become ready (%s); the daemon keeps answering /health with 503", failed)
            # READY all the same: the service is up (admin socket, /health say why), and exiting
            # would only make systemd restart into the same failure every RestartSec.
            self.notifier.ready(f"degraded: engines not ready ({failed}); /health answers 503")
            self._ready_sent = True

    def _worker_failed(self, worker: WorkerHandle) -> None:
        """A worker given up on after the daemon said ready (a crash loop): systemd's status line says so."""
        if self._ready_sent:  # while loading, _load's own lines report it
            self.notifier.status(f"degraded: {worker.name} failed: {worker.error}; /health answers 503")

    def _serving_line(self) -> str:
        n = sum(w.state == HandleState.READY for w in self.workers)
        return f"serving {self.model_name} on {self.url} (mode {self.state.config.mode}, {n} engine workers)"

    # --- signals ----------------------------------------------------------------------------

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_stop_signal(self, sig: int) -> None:
        if self._stop.is_set():
            log.warning("%s again: stopping now without waiting for %d requests", signal.Signals(sig).name,
                        self.state.active)
            self._hurry.set()
            return
        log.info("%s: shutting down (send it again to stop without draining)", signal.Signals(sig).name)
        self._stop.set()

    async def _drain(self) -> None:
        state = self.state
        timeout = state.config.drain_timeout
        self.entries.stopping = True  # a model's daemon that dies now (Ctrl-C reaches the children too) stays down
        state.drain("shutting down")
        self.notifier.stopping(f"draining: {state.active} requests in progress, up to {timeout:g}s")
        self.notifier.extend_timeout(timeout + 30)
        if state.active:
            log.info("draining: waiting up to %gs for %d requests in progress", timeout, state.active)
            hurry = asyncio.ensure_future(self._hurry.wait())
            idle = asyncio.ensure_future(state.wait_idle(timeout))
            await asyncio.wait({hurry, idle}, return_when=asyncio.FIRST_COMPLETED)
            hurry.cancel()
            idle.cancel()
        if state.active:
            log.warning("drain ended with %d requests still running; they are cut off", state.active)
        else:
            log.info("drained: no request in progress")

    async def _reload(self) -> None:
        source = self.state.config.source or "(no config file)"
        ready = self._ready_sent  # while loading, READY=1 must wait for the engines
        if ready:
            self.notifier.reloading()
        try:
            change = self.state.reload()
        except (ConfigError, OSError) as exc:
            log.error("SIGHUP: not reloading: %s; nothing changed (fix the file, then systemctl reload syshaxd)", exc)
        else:
            log.info("SIGHUP: reloaded %s: %s", source, change.describe())
        if ready:
            self.notifier.ready(self._serving_line() if self.scheduler.is_ready() else self._loading_line())

    async def _watchdog(self, interval: float) -> None:
        """WATCHDOG=1 every half WatchdogSec while the loop runs and every loaded worker still heartbeats."""
        limit = max(2 * interval, 5.0)  # a worker sends stats every 0.5 s, idle or busy
        warned = False
        while True:
            now = time.monotonic()
            stale = [w for w in self.workers
                     if not w.remote and w.state == HandleState.READY and now - w.last_heartbeat > limit]
            if stale:
                if not warned:
                    log.error("withholding the watchdog ping: %s sent nothing for over %.0fs",
                              ", ".join(w.name for w in stale), limit)
                warned = True
            else:
                warned = False
                self.notifier.watchdog()
            await asyncio.sleep(interval)


def stop_with_parent(env: MutableMapping[str, str]) -> bool:
    """A chat model's daemon (SYSHAX_PARENT_PID set: engine/chat_models.py) asks the kernel for SIGTERM when its
    parent dies, even by kill -9; False when the parent is gone already."""
    parent = env.pop("SYSHAX_PARENT_PID", "")
    if not parent:
        return True
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    return str(os.getppid()) == parent  # checked after the prctl: a parent that died before it is seen here


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not stop_with_parent(os.environ):
        print("syshaxd: the daemon that started this one is gone; not starting", file=sys.stderr)
        return 1
    overrides = {"host": args.host, "port": args.port, "mode": args.mode, "model": args.model,
                 "models_dir": args.models_dir,
                 "log_level": args.log_level, "quantize": os.environ.get("SYSHAX_QUANTIZE"), "node_listen": args.node}
    path = find_config(args.config)
    try:
        cfg = load(path, overrides)
        keys = KeyCheck.from_config(cfg)  # read once: a reload checks the file again but keys change at a restart
    except ConfigError as exc:
        print(f"syshaxd: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=getattr(logging, cfg.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for warning in hook_warnings(os.environ):  # a test hook left in a production unit must not go unnoticed
        log.warning("%s", warning)
    if flat_keys_warning(cfg):  # a file written before the tables: read as it is, said once
        log.warning("%s", flat_keys_warning(cfg))
    # Before any worker is spawned: they must not inherit NOTIFY_SOCKET (NotifyAccess=main).
    notifier = Notifier.from_env(os.environ, unset_environment=True)
    reload = (lambda: load_checked(path, overrides)) if path is not None else None
    try:
        import uvloop

        if cfg.node_listen:
            from syshaxd.remote.node_main import serve_node

            return uvloop.run(serve_node(cfg, notifier))
        return uvloop.run(serve(cfg, keys, notifier, reload))
    except StartupError as exc:
        notifier.status(f"failed: {exc}")
        print(f"syshaxd: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
