"""Routes each request to engine workers and decides what the daemon can accept."""

from __future__ import annotations

import logging
from collections import Counter, deque

from syshaxd.config import Config
from syshaxd.engine.handoff import HandoffStream
from syshaxd.engine.supervisor import EngineUnavailable, WorkerHandle
from syshaxd.engine.types import GenerateRequest, KVHandle

log = logging.getLogger(__name__)

ROUTES = ("cpu", "gpu", "hetero")  # gpu: the daemon's one generate engine (gpu mode)


class Overloaded(RuntimeError):
    """Every batch slot and queue place is taken; the client should retry later (429)."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RouteUnavailable(ValueError):
    """The request asked for a route this daemon was not started for (400)."""


def _percentile(values, q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Scheduler:
    """`cpu`: one CPU worker does both phases. `hetero`: the prefill worker, then a CPU decoder.

    A hetero daemon also serves `cpu` requests (a decoder runs the prompt itself), which is
    how a request's `"syshax": {"mode": ...}` override compares the two on one daemon.
    """

    def __init__(self, config: Config, workers: list[WorkerHandle], ring=None) -> None:
        self.config = config
        self.workers = workers
        self.prefill = [w for w in workers if w.spec.role == "prefill"]
        self.decoders = [w for w in workers if w.spec.role != "prefill"]
        self.ring = ring
        self.routes: Counter = Counter()
        self.refused: Counter = Counter()
        self.handoff = {"records_written": 0, "bytes_written": 0, "records_read": 0, "records_failed": 0,
                        "fallbacks": Counter(), "latency": deque(maxlen=1000)}
        for w in self.prefill:
            w.on_orphan_record = self.release_record

    @property
    def mode(self) -> str:
        return self.config.mode

    def is_ready(self) -> bool:
        return bool(self.workers) and all(w.state == "ready" for w in self.workers)

    def capacity(self) -> int:
        """Requests the daemon holds at once: every decode batch slot plus the waiting queue."""
        slots = sum(w.spec.max_batch_size for w in self.decoders if w.state == "ready")
        return slots + self.config.max_queue_size

    def in_flight(self) -> int:
        return sum(w.in_flight for w in self.workers)

    def pick_decoder(self) -> WorkerHandle:
        ready = [w for w in self.decoders if w.state == "ready"]
        if not ready:
            raise EngineUnavailable(f"no decode worker is ready ({self._states(self.decoders)}); retry shortly")
        return min(ready, key=lambda w: w.in_flight)

    def submit(self, request: GenerateRequest):
        """A stream of the request's events; raises Overloaded, EngineUnavailable or RouteUnavailable."""
        route = request.route or self.mode
        if route not in ROUTES:
            raise RouteUnavailable(f"route {route!r} is not one this daemon serves ({', '.join(ROUTES)})")
        if route == "hetero" and not self.prefill:
            raise RouteUnavailable("hetero needs a prefill worker: start the daemon with mode = \"hetero\"")
        if not any(w.state == "ready" for w in self.decoders):
            self.refused["unavailable"] += 1
            raise EngineUnavailable(f"no engine is ready to serve ({self._states(self.workers)}); retry shortly")
        if self.in_flight() >= self.capacity():
            self.refused["overloaded"] += 1
            raise Overloaded(
                f"the server is at capacity ({self.in_flight()} requests in flight, "
                f"queue of {self.config.max_queue_size} full); retry later"
            )
        if route == "hetero":
            prefill = min(self.prefill, key=lambda w: w.in_flight)
            if prefill.state != "ready":
                # the prefill worker is restarting: decode it on the CPU meanwhile, and say so
                self.handoff["fallbacks"]["prefill_unavailable"] += 1
                stream = self.pick_decoder().submit(request)
            else:
                stream = HandoffStream(self, request, prefill)
        else:
            stream = self.pick_decoder().submit(request)
        self.routes[route] += 1
        return stream

    def release_record(self, handle: KVHandle) -> None:
        """Free a ring record that no decoder will take (its request was cancelled or re-routed)."""
        if self.ring is None:
            return
        from syshaxd.kv.ring import RingError

        try:
            self.ring.release(handle.offset)
        except RingError as exc:  # already released by a decoder that died after reading it
            log.debug("record at %d already gone: %s", handle.offset, exc)

    @staticmethod
    def _states(workers) -> str:
        return ", ".join(f"{w.name} {w.state}" + (f" ({w.error})" if w.error else "") for w in workers) or "none"

    def kv_status(self) -> dict | None:
        if self.ring is None:
            return None
        ring = self.ring.stats()
        lat = list(self.handoff["latency"])
        return {
            "ring": {"capacity": self.ring.capacity, "used_bytes": ring.used_bytes, "occupancy": ring.occupancy,
                     "records_written": ring.records_written, "records_released": ring.records_released,
                     "records_skipped": ring.records_skipped, "generation": ring.generation},
            "records_written": self.handoff["records_written"],
            "records_read": self.handoff["records_read"],
            "records_failed": self.handoff["records_failed"],
            "bytes_moved": self.handoff["bytes_written"],
            "fallbacks": dict(self.handoff["fallbacks"]),
            "handoff_latency_s": {"count": len(lat), "p50": _percentile(lat, 0.5), "p99": _percentile(lat, 0.99)},
        }

    def status(self) -> dict:
        return {
            "mode": self.mode,
            "ready": self.is_ready(),
            "in_flight": self.in_flight(),
            "capacity": self.capacity(),
            "max_queue_size": self.config.max_queue_size,
            "routes": dict(self.routes),
            "refused": dict(self.refused),
            "kv": self.kv_status(),
            "workers": [w.status() for w in self.workers],
        }
