"""Owns every request's route -- cpu, gpu, hetero, or auto (sysHAX's PD offload) -- and what the daemon admits."""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections import Counter, deque
from dataclasses import asdict, replace

from syshaxd.config import MODES, Config
from syshaxd.engine.decider import Decision, EngineState, Thresholds, decide
from syshaxd.engine.handoff import HandoffStream
from syshaxd.engine.offload import OffloadStream
from syshaxd.engine.supervisor import EngineUnavailable, WorkerHandle
from syshaxd.engine.types import GenerateRequest, KVHandle

log = logging.getLogger(__name__)

ORPHAN_GRACE = 2.0  # seconds after a KV producer died before its unclaimed records are freed


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
    """Routes requests over three pools of engine workers, as the plan made them:

    * ``cpu``: CPU workers that run both phases (cpu mode) or decode what others prefilled;
    * ``gpu``: the GPU engine (gpu and auto modes), which generates, and in auto mode can also
      run a prompt alone and hand its KV to a CPU worker through the ring;
    * ``prefill``: hetero mode's prefill worker.

    Routes: ``cpu`` (a CPU worker does it all), ``gpu`` (the GPU engine does it all), ``hetero``
    (the prefill worker, or the GPU engine, runs the prompt; a CPU worker decodes), and ``auto``,
    which asks the decider (engine/decider.py) per request from live engine state. The daemon's
    mode is the default route; a request may name another that this daemon serves.
    """

    def __init__(self, config: Config, workers: list[WorkerHandle], ring=None) -> None:
        self.config = config
        self.workers = workers
        self.pools = {pool: [w for w in workers if w.spec.pool == pool] for pool in ("cpu", "gpu", "prefill")}
        self.decoders = self.pools["cpu"]
        self.prefill = self.pools["prefill"]
        self.gpu = self.pools["gpu"]
        self.ring = ring
        self.routes: Counter = Counter()
        self.refused: Counter = Counter()
        self.handoff = {"records_written": 0, "bytes_written": 0, "records_read": 0, "records_failed": 0,
                        "orphans_released": 0, "fallbacks": Counter(), "latency": deque(maxlen=1000)}
        self.auto = {"decisions": Counter(), "queued": 0, "reconsidered": 0, "moved_to_gpu": 0, "move_failed": 0,
                     "last": None}
        self._handoffs: weakref.WeakSet = weakref.WeakSet()  # hetero requests that may hold a ring record
        for w in self.prefill + self.gpu:
            w.on_orphan_record = self.release_record
            w.on_exit = self.producer_died
        self._unservable = self._why_unservable()  # the pools never change: worked out once, read per request

    @property
    def mode(self) -> str:
        return self.config.mode

    # --- what this daemon can serve -----------------------------------------------------------

    def servable_modes(self) -> dict[str, str]:
        """Each mode, and why this daemon cannot route to it ("" when it can)."""
        return dict(self._unservable)

    def _why_unservable(self) -> dict[str, str]:
        restart = "; set mode = \"{}\" in the config file (syshax config set mode {} --save) and restart syshaxd"
        exports = any(w.spec.ring for w in self.gpu)
        why = {}
        why["cpu"] = "" if self.decoders else "this daemon has no CPU workers (gpu mode)" + restart.format("auto", "auto")
        why["gpu"] = "" if self.gpu else "this daemon has no GPU engine" + restart.format("gpu", "gpu")
        if not self.decoders or not (self.prefill or exports):
            why["hetero"] = "this daemon has no prefill engine, CPU decoders and KV ring" + restart.format("hetero",
                                                                                                       "hetero")
        else:
            why["hetero"] = ""
        if not (self.gpu and exports and self.decoders):
            why["auto"] = "auto needs the GPU engine, CPU decoders and the KV ring between them" + restart.format(
                "auto", "auto")
        else:
            why["auto"] = ""
        return why

    def set_mode(self, mode: str) -> None:
        """The default route of new requests; raises ValueError when this daemon cannot serve it."""
        if mode not in MODES:
            raise ValueError(f"mode: must be one of {', '.join(MODES)}; got {mode!r}")
        reason = self._unservable[mode]
        if reason:
            raise ValueError(f"mode {mode!r} is not available: {reason}")
        self.config = self.config.replace(mode=mode)

    def is_ready(self) -> bool:
        return bool(self.workers) and all(w.state == "ready" for w in self.workers)

    # --- admission ----------------------------------------------------------------------------

    def slots(self, pool: str) -> int:
        return sum(w.spec.max_batch_size for w in self.pools[pool] if w.state == "ready")

    def capacity(self) -> int:
        """Requests the daemon holds at once: every batch slot of the CPU and GPU engines plus the queue."""
        return self.slots("cpu") + self.slots("gpu") + self.config.max_queue_size

    def in_flight(self) -> int:
        return sum(w.in_flight for w in self.workers)

    def queued(self) -> int:
        """Requests admitted beyond the engines' batch slots: they wait in an engine's queue."""
        return max(0, sum(w.generating for w in self.workers) - self.slots("cpu") - self.slots("gpu"))

    @classmethod
    def _least_loaded(cls, workers: list[WorkerHandle], what: str) -> WorkerHandle:
        ready = [w for w in workers if w.state == "ready"]
        if not ready:
            raise EngineUnavailable(f"no {what} is ready ({cls._states(workers)}); retry shortly")
        return min(ready, key=lambda w: w.in_flight)

    def pick_decoder(self) -> WorkerHandle:
        return self._least_loaded(self.decoders, "CPU worker")

    def pick_gpu(self) -> WorkerHandle:
        return self._least_loaded(self.gpu, "GPU engine")

    def submit(self, request: GenerateRequest):
        """A stream of the request's events; raises Overloaded, EngineUnavailable or RouteUnavailable."""
        route = request.route or self.mode
        if route not in MODES:
            raise RouteUnavailable(f"route {route!r} is not one of {', '.join(MODES)}")
        why = self._unservable[route]
        if why:
            raise RouteUnavailable(f"this daemon cannot serve route {route!r}: {why}")
        needed = self.gpu if route == "gpu" else self.decoders
        if not any(w.state == "ready" for w in needed):
            self.refused["unavailable"] += 1
            raise EngineUnavailable(f"no engine is ready to serve ({self._states(needed)}); retry shortly")
        if self.in_flight() >= self.capacity():
            self.refused["overloaded"] += 1
            raise Overloaded(
                f"the server is at capacity ({self.in_flight()} requests in flight, "
                f"queue of {self.config.max_queue_size} full); retry later"
            )
        decision = None
        if route == "auto" and not any(w.state == "ready" for w in self.gpu):
            # the GPU engine is loading or being restarted: the CPU workers serve meanwhile
            decision = Decision("cpu", f"the GPU engine is not ready ({self._states(self.gpu)}); serving on the CPU")
            self.auto["decisions"]["cpu"] += 1
            route = "cpu"
        elif route == "auto":
            decision = self.decide()
            if decision.route == "refuse":
                # both sides are full: wait in the GPU engine's queue, which admission bounded above
                self.auto["queued"] += 1
                decision = replace(decision, route="gpu", reason=f"{decision.reason}; queued for the GPU engine")
            route = decision.route
        stream = self._dispatch(route, request, decision)
        self.routes[route] += 1
        return stream

    def _dispatch(self, route: str, request: GenerateRequest, decision: Decision | None):
        if route == "cpu":
            stream = self.pick_decoder().submit(request)
        elif route == "gpu":
            stream = self.pick_gpu().submit(request)
        else:
            prefill = min(self.prefill or self.gpu, key=lambda w: w.in_flight)
            if prefill.state != "ready":
                # the prefill engine is restarting: decode it on the CPU meanwhile, and say so
                self.handoff["fallbacks"]["prefill_unavailable"] += 1
                stream = self.pick_decoder().submit(request)
            else:
                stream = HandoffStream(self, request, prefill)
                self._handoffs.add(stream)
            if decision is not None and decision.token_limit:
                stream = OffloadStream(self, request, stream, decision.token_limit)
        stream.route = route
        stream.reason = decision.reason if decision is not None else ""
        return stream

    # --- auto: sysHAX's offload decider over live engine state ----------------------------------

    def thresholds(self) -> Thresholds:
        c = self.config
        return Thresholds(max_num_seqs=self.slots("gpu") or c.max_num_seqs, gpu_cache_threshold=c.gpu_cache_threshold,
                          cpu_throughput_threshold=c.cpu_throughput_threshold,
                          cpu_max_batch_size=self.slots("cpu"),
                          token_limit_multiplier=c.token_limit_multiplier, token_limit_min=c.token_limit_min,
                          token_limit_max=c.token_limit_max)

    def engine_state(self, pool: str) -> EngineState:
        """A pool's load. Running and waiting come from the daemon's own count of what each worker holds
        (exact the moment a request is sent, where a worker's report is up to one step old), waiting also
        from the workers' reports (an engine may queue below its batch size: vLLM preempts sequences when
        its KV cache runs out); KV usage and recent tokens/s from the reports."""
        workers = [w for w in self.pools[pool] if w.state == "ready"]
        held = sum(w.generating for w in workers)  # an offloaded prompt on the GPU engine takes no slot there
        slots = sum(w.spec.max_batch_size for w in workers)
        reported_waiting = sum(int(w.stats.get("waiting", 0)) for w in workers)
        return EngineState(running=min(held, slots), waiting=max(held - slots, reported_waiting, 0),
                           kv_usage=max((float(w.stats.get("kv_usage", 0.0)) for w in workers), default=0.0),
                           tokens_per_second=sum(float(w.stats.get("tokens_per_second", 0.0)) for w in workers))

    def decide(self) -> Decision:
        """The decider's answer for an auto request now -- "gpu", "hetero", or "refuse" when both sides are
        full -- remembered with its inputs for the status."""
        gpu, cpu, t = self.engine_state("gpu"), self.engine_state("cpu"), self.thresholds()
        decision = decide(gpu, cpu, t)
        self.auto["decisions"][decision.route] += 1
        self.auto["last"] = {"at": time.time(), "gpu": asdict(gpu), "cpu": asdict(cpu), "route": decision.route,
                             "reason": decision.reason, "token_limit": decision.token_limit}
        log.debug("auto: %s (%s)", decision.route, decision.reason)
        return decision

    # --- the KV ring ----------------------------------------------------------------------------

    def release_record(self, handle: KVHandle) -> None:
        """Free a ring record that no decoder will take (its request was cancelled or re-routed)."""
        self._release_offset(handle.offset)

    def _release_offset(self, offset: int) -> None:
        if self.ring is None:
            return
        from syshaxd.kv.ring import RingError

        try:
            self.ring.release(offset)
        except RingError as exc:  # already released by a decoder that died after reading it
            log.debug("record at %d already gone: %s", offset, exc)

    def producer_died(self, pid: int) -> None:
        """A worker that writes KV records died: soon free the records it committed that no request holds.

        It may have died after committing a record and before reporting it; nobody would release that
        one, and the ring's tail would stick behind it. The grace lets the requests it did report take
        up their records first; a record freed under a request anyway only makes its decoder recompute.
        """
        if self.ring is not None:
            asyncio.get_running_loop().call_later(ORPHAN_GRACE, self.release_orphans, pid)

    def release_orphans(self, pid: int) -> int:
        """Release the committed records of writer `pid` that no live hetero request holds; how many."""
        if self.ring is None:
            return 0
        held = {stream.handle.offset for stream in self._handoffs if stream.handle is not None}
        freed = 0
        for record in list(self.ring.records()):
            if record.state == "committed" and record.writer_pid == pid and record.offset not in held:
                self._release_offset(record.offset)
                freed += 1
        if freed:
            self.handoff["orphans_released"] += freed
            log.warning("freed %d KV record(s) that KV producer pid %d committed but never handed on", freed, pid)
        return freed

    @staticmethod
    def _states(workers) -> str:
        return ", ".join(f"{w.name} {w.state}" + (f" ({w.error})" if w.error else "") for w in workers) or "none"

    # --- status ---------------------------------------------------------------------------------

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
            "orphans_released": self.handoff["orphans_released"],
            "bytes_moved": self.handoff["bytes_written"],
            "fallbacks": dict(self.handoff["fallbacks"]),
            "handoff_latency_s": {"count": len(lat), "p50": _percentile(lat, 0.5), "p99": _percentile(lat, 0.99)},
        }

    def auto_status(self) -> dict | None:
        """The decider's counts and its last inputs and decision (what `syshax status` explains)."""
        if self._unservable["auto"]:
            return None
        return {"decisions": dict(self.auto["decisions"]), "queued_for_gpu": self.auto["queued"],
                "reconsidered": self.auto["reconsidered"], "moved_to_gpu": self.auto["moved_to_gpu"],
                "move_failed": self.auto["move_failed"], "last": self.auto["last"],
                "thresholds": asdict(self.thresholds())}

    def status(self) -> dict:
        return {
            "mode": self.mode,
            "modes": {m: why or "available" for m, why in self._unservable.items()},
            "ready": self.is_ready(),
            "in_flight": self.in_flight(),
            "queued": self.queued(),
            "capacity": self.capacity(),
            "max_queue_size": self.config.max_queue_size,
            "routes": dict(self.routes),
            "refused": dict(self.refused),
            "auto": self.auto_status(),
            "kv": self.kv_status(),
            "workers": [w.status() for w in self.workers],
        }
