"""Routes each request to an engine worker and decides what the daemon can accept."""

from __future__ import annotations

import logging
from collections import Counter

from syshaxd.config import Config
from syshaxd.engine.supervisor import EngineUnavailable, RequestStream, WorkerHandle
from syshaxd.engine.types import GenerateRequest

log = logging.getLogger(__name__)


class Overloaded(RuntimeError):
    """Every batch slot and queue place is taken; the client should retry later (429)."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Scheduler:
    """In `cpu` mode one kind of worker does both phases; later modes add routes here."""

    def __init__(self, config: Config, workers: list[WorkerHandle]) -> None:
        self.config = config
        self.workers = workers
        self.routes: Counter = Counter()
        self.refused: Counter = Counter()

    @property
    def mode(self) -> str:
        return self.config.mode

    def is_ready(self) -> bool:
        return bool(self.workers) and all(w.state == "ready" for w in self.workers)

    def capacity(self) -> int:
        """Requests the daemon holds at once: every batch slot plus the waiting queue."""
        slots = sum(w.spec.max_batch_size for w in self.workers if w.state == "ready")
        return slots + self.config.max_queue_size

    def in_flight(self) -> int:
        return sum(w.in_flight for w in self.workers)

    def submit(self, request: GenerateRequest) -> RequestStream:
        ready = [w for w in self.workers if w.state == "ready"]
        if not ready:
            states = ", ".join(f"{w.name} {w.state}" + (f" ({w.error})" if w.error else "") for w in self.workers)
            self.refused["unavailable"] += 1
            raise EngineUnavailable(f"no engine is ready to serve ({states}); retry shortly")
        if self.in_flight() >= self.capacity():
            self.refused["overloaded"] += 1
            raise Overloaded(
                f"the server is at capacity ({self.in_flight()} requests in flight, "
                f"queue of {self.config.max_queue_size} full); retry later"
            )
        worker = min(ready, key=lambda w: w.in_flight)
        stream = worker.submit(request)
        self.routes[self.mode] += 1
        return stream

    def status(self) -> dict:
        return {
            "mode": self.mode,
            "ready": self.is_ready(),
            "in_flight": self.in_flight(),
            "capacity": self.capacity(),
            "max_queue_size": self.config.max_queue_size,
            "routes": dict(self.routes),
            "refused": dict(self.refused),
            "workers": [w.status() for w in self.workers],
        }
