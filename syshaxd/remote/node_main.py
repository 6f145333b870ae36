"""A decode node's process: `syshaxd --node` (node_listen set) plans its decoders and its ring, starts them and
the NodeServer (remote/node.py) that serves its fronts, tells systemd how it goes, and stops them all at SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import ssl
import time

from syshaxd.config import split_address
from syshaxd.engine.kv_ledger import KVLedger
from syshaxd.engine.supervisor import WorkerHandle
from syshaxd.remote import wire
from syshaxd.remote.node import NodeServer
from syshaxd.remote.transfer import TransferEngine, TransferUnavailable
from syshaxd.startup import StartupError, create_ring
from syshaxd.engine.lifecycle import HandleState

log = logging.getLogger("syshaxd.remote.node")  # the node's log lines keep their logger's name


async def serve_node(cfg, notifier, stop: asyncio.Event | None = None) -> int:
    """Run this daemon as a decode node (node_listen set) until SIGTERM or SIGINT."""
    from syshaxd.engine.plan import PlanError, plan_node
    from syshaxd.sdk.gguf.header import GGUFError, fingerprint_from_gguf
    from syshaxd.model import ModelError, resolve_model, served_name

    host, port = split_address(cfg.node_listen, "node_listen")  # checked with the config
    try:
        secret = wire.read_secret(cfg.node_secret_file)
    except (OSError, ValueError) as exc:
        raise StartupError(f"node_secret_file: {exc}") from None
    try:
        model_path = resolve_model(cfg.model, cfg.model_dir_path())
        engines = plan_node(cfg, model_path, served_name(cfg.model_name, model_path), dict(os.environ))
        fingerprint = fingerprint_from_gguf(model_path).to_bytes()
    except (ModelError, PlanError, GGUFError, OSError) as exc:
        raise StartupError(str(exc)) from None
    try:
        tls = wire.tls_context(True, cfg.node_tls_cert, cfg.node_tls_key, cfg.node_tls_ca)
    except (OSError, ssl.SSLError) as exc:
        raise StartupError(f"node_tls_cert, node_tls_key, node_tls_ca: {exc}") from None
    try:
        transfer = TransferEngine(host, cfg.node_transfer_protocol, cfg.node_transfer_device)
    except TransferUnavailable as exc:
        raise StartupError(str(exc)) from None
    assert engines.ring is not None  # plan_node always plans the node's ring
    ring = create_ring(engines.ring)
    ledger = KVLedger(ring)
    workers = [WorkerHandle(name, spec, cfg.log_level, cfg.worker_restart_delay, cfg.worker_heartbeat_timeout,
                            ledger) for name, spec in engines.workers]
    model_name = served_name(cfg.model_name, model_path)
    server = NodeServer(host, port, secret, workers, ring, transfer, ledger, cfg.cpu_engine, model_name, fingerprint,
                        cfg.tiled_attention, cfg.node_front_slots, cfg.node_link_timeout, tls)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # the same unit runs a front or a node: a reload is answered, not fatal
    loop.add_signal_handler(signal.SIGHUP, lambda: log.warning(
        "SIGHUP: a decode node applies its config at a restart (systemctl restart syshaxd); nothing changed"))
    notifier.extend_timeout(cfg.worker_start_timeout + 30)
    notifier.status(f"decode node: loading {len(workers)} decoders")
    watchdog = asyncio.ensure_future(_watchdog(notifier, workers))
    try:
        try:
            await server.start()
        except OSError as exc:
            raise StartupError(f"node_listen: cannot listen on {host}:{port}: {exc.strerror}") from None
        for w in workers:
            w.start()
        waiting = asyncio.ensure_future(_ready_when_loaded(workers, notifier, server, cfg.worker_start_timeout))
        await stop.wait()
        waiting.cancel()
        log.info("stopping the decode node")
        notifier.stopping("decode node: stopping; the front's requests here go on elsewhere")
        await server.close()
        await asyncio.gather(*(w.stop() for w in workers))
    finally:
        watchdog.cancel()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        ring.unlink()
        ring.close()
    return 0


async def _watchdog(notifier, workers: list[WorkerHandle]) -> None:
    """WATCHDOG=1 every half WatchdogSec while the loop runs and no loaded decoder has gone silent."""
    interval = notifier.watchdog_interval()
    if not interval:
        return
    limit = max(2 * interval, 5.0)
    while True:
        now = time.monotonic()
        if not any(w.state == HandleState.READY and now - w.last_heartbeat > limit for w in workers):
            notifier.watchdog()
        await asyncio.sleep(interval)


async def _ready_when_loaded(workers, notifier, server: NodeServer, timeout: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline and not all(w.state in (HandleState.READY, HandleState.FAILED) for w in workers):
        await asyncio.sleep(0.25)
    ready = sum(w.state == HandleState.READY for w in workers)
    line = f"decode node on {server.host}:{server.port}: {ready} of {len(workers)} decoders ready"
    log.info("%s", line)
    print(f"syshaxd node ready on {server.host}:{server.port}", flush=True)
    notifier.ready(line)


__all__ = ["serve_node"]
