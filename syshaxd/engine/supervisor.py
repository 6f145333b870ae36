"""Daemon side of one engine worker: spawns it, routes its events, notices death, restarts it."""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import time
from dataclasses import dataclass, field

from syshaxd.engine.types import (
    Accepted,
    Cancel,
    Delta,
    EngineSpec,
    GenerateRequest,
    Prefilled,
    Rejected,
    Shutdown,
    Submit,
    WorkerFailed,
    WorkerReady,
    WorkerStats,
)
from syshaxd.engine.worker import worker_main

log = logging.getLogger(__name__)


class EngineUnavailable(RuntimeError):
    """No worker can take the request right now (loading, restarting or failed)."""


@dataclass(eq=False)
class RequestStream:
    """One request's events from its worker, in order; the last is a finished Delta or Rejected."""

    request_id: str
    worker: "WorkerHandle"
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    tokens_sent: int = 0
    finished: bool = False

    async def next_event(self):
        event = await self.queue.get()
        if isinstance(event, Delta):
            self.tokens_sent += event.n_tokens
            if event.finish_reason is not None:
                self.finished = True
        elif isinstance(event, (Rejected, Prefilled)):
            self.finished = True
        return event

    def cancel(self) -> None:
        """Stop generating (client gone, timeout); frees the sequence on the worker."""
        if not self.finished:
            self.finished = True
            self.worker.cancel(self.request_id)


class WorkerHandle:
    _ids = itertools.count()

    def __init__(self, name: str, spec: EngineSpec, log_level: str, restart_delay: float) -> None:
        self.name = name
        self.spec = spec
        self.log_level = log_level
        self.restart_delay = restart_delay
        self.state = "stopped"
        self.info: dict = {}
        self.stats: dict = {}
        self.error = ""
        self.restarts = 0
        self.last_heartbeat = 0.0
        self.streams: dict[str, RequestStream] = {}
        self.ready = asyncio.Event()
        self._process = None
        self._conn = None
        self._stopping = False
        self._restart_task: asyncio.Task | None = None
        self._loop = asyncio.get_running_loop()
        self.on_orphan_record = None  # called with a Prefilled whose request is gone (its record must go)

    # --- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        self._process = ctx.Process(
            target=worker_main, args=(child, self.spec, self.name, self.log_level), name=self.name, daemon=True
        )
        self.state = "starting"
        self.ready.clear()
        self._process.start()
        child.close()
        self._conn = parent
        self._loop.add_reader(parent.fileno(), self._on_readable)
        self._loop.add_reader(self._process.sentinel, self._on_exit)
        log.info("%s: started worker pid %d (%s, %s)", self.name, self._process.pid, self.spec.backend, self.spec.role)

    async def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        if self._restart_task:
            self._restart_task.cancel()
        proc = self._process
        if proc is None:
            return
        if self._conn is not None:
            try:
                self._conn.send(Shutdown())
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + timeout
        while proc.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if proc.is_alive():
            log.warning("%s: worker did not stop in %.0fs; killing it", self.name, timeout)
            proc.kill()
            proc.join(2)
        self._detach()
        self.state = "stopped"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def _detach(self) -> None:
        if self._conn is not None:
            self._loop.remove_reader(self._conn.fileno())
            self._conn.close()
            self._conn = None
        if self._process is not None:
            self._loop.remove_reader(self._process.sentinel)
            self._process = None

    # --- events from the worker -----------------------------------------------------------

    def _on_readable(self) -> None:
        try:
            while self._conn is not None and self._conn.poll():
                self._dispatch(self._conn.recv())
        except (EOFError, OSError):
            # the worker closed its end; its exit (the sentinel) does the clean-up
            if self._conn is not None:
                self._loop.remove_reader(self._conn.fileno())
                self._conn.close()
                self._conn = None

    def _dispatch(self, msg) -> None:
        self.last_heartbeat = time.monotonic()
        if isinstance(msg, list):
            for event in msg:
                stream = self.streams.get(event.request_id)
                if stream is None:  # cancelled on our side already
                    if isinstance(event, Prefilled) and event.handle is not None and self.on_orphan_record:
                        self.on_orphan_record(event.handle)
                    continue
                if isinstance(event, (Rejected, Prefilled)) or (isinstance(event, Delta) and event.finish_reason):
                    del self.streams[event.request_id]
                stream.queue.put_nowait(event)
        elif isinstance(msg, WorkerStats):
            self.stats = msg.stats
        elif isinstance(msg, WorkerReady):
            self.info = msg.info
            self.state = "ready"
            self.error = ""
            self.ready.set()
            log.info("%s: ready (%s, n_ctx=%s, batch=%s, cpus=%s)", self.name, self.info.get("model_name"),
                     self.info.get("n_ctx"), self.info.get("max_batch_size"), self.info.get("cpus"))
        elif isinstance(msg, WorkerFailed):
            self.error = msg.message
            self.state = "failed"
            log.error("%s: engine failed to start: %s", self.name, msg.message)

    def _on_exit(self) -> None:
        if self._process is None:
            return
        self._process.join(1)
        code = self._process.exitcode
        if self._conn is not None:
            self._on_readable()  # events it sent just before dying still count
        was_failed = self.state == "failed"
        self._detach()
        self.ready.clear()
        lost = list(self.streams.values())
        self.streams.clear()
        for stream in lost:
            if stream.tokens_sent == 0 and stream.queue.empty():
                stream.queue.put_nowait(
                    Rejected(stream.request_id, 503, "the engine worker stopped before answering; retry the request",
                             "engine_restarting")
                )
            else:
                stream.queue.put_nowait(Delta(stream.request_id, "", 0, "error", "the engine worker died mid-stream"))
        if self._stopping:
            return
        if was_failed:
            return  # the engine cannot be built; restarting would fail the same way
        self.state = "restarting"
        self.restarts += 1
        log.error("%s: worker exited (code %s) with %d requests in flight; restarting in %.1fs",
                  self.name, code, len(lost), self.restart_delay)
        self._restart_task = self._loop.create_task(self._restart_later())

    async def _restart_later(self) -> None:
        await asyncio.sleep(self.restart_delay)
        if not self._stopping:
            self.start()

    # --- requests -------------------------------------------------------------------------

    def submit(self, request: GenerateRequest) -> RequestStream:
        if self.state != "ready" or self._conn is None:
            raise EngineUnavailable(f"{self.name} is {self.state}")
        stream = RequestStream(request.request_id, self)
        self.streams[request.request_id] = stream
        self._conn.send(Submit(request))
        return stream

    def cancel(self, request_id: str) -> None:
        self.streams.pop(request_id, None)
        if self._conn is not None:
            try:
                self._conn.send(Cancel(request_id))
            except (OSError, ValueError):
                pass

    @property
    def in_flight(self) -> int:
        return len(self.streams)

    def status(self) -> dict:
        return {
            "name": self.name,
            "backend": self.spec.backend,
            "role": self.spec.role,
            "state": self.state,
            "pid": self.pid,
            "error": self.error,
            "restarts": self.restarts,
            "in_flight": self.in_flight,
            "cpus": self.info.get("cpus", []),
            "threads": self.spec.threads,
            "stats": self.stats,
        }


__all__ = ["Accepted", "EngineUnavailable", "RequestStream", "WorkerHandle"]
