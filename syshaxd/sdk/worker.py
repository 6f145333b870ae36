"""The engine worker process: builds one engine through its plugin and runs its busy loop."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import time
from multiprocessing.connection import Connection

from syshaxd.sdk import faults
from syshaxd.sdk.types import (
    Cancel,
    Embed,
    EngineSpec,
    ModelNotServable,
    Shutdown,
    Submit,
    WorkerFailed,
    WorkerReady,
    WorkerStats,
    WorkerWarming,
)

log = logging.getLogger(__name__)

STATS_INTERVAL = 0.5  # seconds; doubles as the worker's heartbeat
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL this worker if the daemon dies (even by kill -9)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _setup_logging(name: str, level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s %(levelname)s [{name}] %(name)s: %(message)s",
    )
    # llama-cpp-python prints llama.cpp's own log to stderr below this level
    logging.getLogger("llama-cpp-python").setLevel(logging.DEBUG if level == "debug" else logging.ERROR)


def worker_main(conn: Connection, spec: EngineSpec, name: str, log_level: str) -> None:
    """Entry point of the worker process (multiprocessing 'spawn' target)."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon decides when workers stop
    _setup_logging(name, log_level)
    applied = None
    if spec.gpu.devices:  # before torch or vLLM look: this engine sees its own devices alone (gpu_devices)
        os.environ["CUDA_VISIBLE_DEVICES"] = spec.gpu.devices
    if spec.placement is not None:
        from syshaxd.sdk.placement import apply_placement

        # before the model loads, so its pages and threads land on this node
        applied = apply_placement(spec.placement)
    try:
        from syshaxd.sdk.plugins import find_backend, make_plugin_manager

        backend = find_backend(make_plugin_manager(), spec.backend)
        availability = backend.availability()
        if not availability.available:
            raise RuntimeError(f"backend {spec.backend} is unavailable here: {availability.reason}")
        engine = backend.create_engine(spec)
    except Exception as exc:
        log.exception("could not build the %s engine", spec.backend)
        conn.send(WorkerFailed(f"{type(exc).__name__}: {exc}"))
        return
    info = engine.info() | {
        "pid": os.getpid(),
        "cpus": sorted(os.sched_getaffinity(0)),
        "mempolicy": applied.mempolicy if applied else "default",
        "mem_nodes": list(applied.mem_nodes) if applied else [],
    }
    # Prove the kernels before saying ready: if they crash on this CPU, the supervisor sees the death while
    # warming and restarts with safer kernels, or reports the worker failed (at once when the engine says the
    # model is the cause: ModelNotServable).
    safer, loses = engine.safer_kernels() if hasattr(engine, "safer_kernels") else ({}, "")
    conn.send(WorkerWarming(info, safer, loses))
    kernels = str(info.get("kernels", "plain"))
    faults.crash_at(spec.fault, "warmup", kernels)
    started = time.monotonic()
    try:
        if hasattr(engine, "warm_up"):
            engine.warm_up()
    except Exception as exc:
        log.exception("the warm-up failed")
        conn.send(WorkerFailed(f"{type(exc).__name__}: {exc}", during="warm-up",
                               kernels_suspect=not isinstance(exc, ModelNotServable)))
        engine.close()
        return
    log.info("warm-up passed in %.2fs (kernels: %s)", time.monotonic() - started, kernels)
    # with what the warm-up found out, and what it proved for the worker's restarts
    conn.send(WorkerReady(info | engine.info(), engine.proofs() if hasattr(engine, "proofs") else None))
    try:
        _loop(conn, engine, spec.fault, kernels, spec.step_delay)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        log.info("daemon went away; exiting")
    finally:
        engine.close()


def _loop(conn: Connection, engine, fault: str = "", kernels: str = "plain", step_delay: float = 0.0) -> None:
    next_stats = 0.0
    while True:
        busy = engine.has_work()
        out: list = []
        if conn.poll(0 if busy else STATS_INTERVAL):
            while conn.poll():
                msg = conn.recv()
                if isinstance(msg, Submit):
                    out += engine.submit(msg.request, msg.handling)
                elif isinstance(msg, Embed):  # an embedding engine's (Role.EMBED): batched at its next step
                    out += engine.embed(msg.request)
                elif isinstance(msg, Cancel):
                    out += engine.cancel(msg.request_id)
                elif isinstance(msg, Shutdown):
                    if out:
                        conn.send(out)
                    return
        if engine.has_work():
            if fault:
                faults.crash_at(fault, "decode", kernels)
            out += engine.step()
            if step_delay:
                time.sleep(step_delay)  # SYSHAX_SLOW: an engine this much slower per step
        if out:
            conn.send(out)
        now = time.monotonic()
        if now >= next_stats:
            conn.send(WorkerStats(engine.stats()))
            next_stats = now + STATS_INTERVAL
