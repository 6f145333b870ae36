"""What the scheduler holds for each engine it sends requests to: the EngineHandle protocol, the WorkerStream an
attempt's events arrive on, and EngineUnavailable, raised where no engine can take a request.

Two classes implement it: a worker process of this host (engine/supervisor.py: WorkerHandle, which runs
prefill, decode or both) and a decode node on another host (remote/front.py: RemoteNode, one more CPU decoder
with the slots of all the node's decoders). The scheduler, the journeys and the status read only what is
declared here, so a remote node is never a WorkerHandle in disguise: mypy checks both against this protocol
wherever the daemon puts them in its list (tests/structure/test_types.py runs it).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Protocol

from syshaxd.engine.lifecycle import HandleState
from syshaxd.engine.status import RemoteNodeStatus, WorkerStatus
from syshaxd.sdk.types import (
    Delta,
    Embedded,
    EngineSpec,
    EngineStats,
    GenerateRequest,
    Handling,
    Prefilled,
    Rejected,
    Route,
    WorkerLost,
)


class EngineUnavailable(RuntimeError):
    """No worker can take the request right now (loading, restarting or failed); final: all failed for good."""

    def __init__(self, message: str, final: bool = False) -> None:
        super().__init__(message)
        self.final = final


@dataclass(eq=False)
class WorkerStream:
    """One attempt of a request on a worker, its events in order; the last is a finished Delta, Rejected or Prefilled.

    A journey (engine/journey.py) reads it; a worker's death ends it with a WorkerLost. The worker knows the request
    by `attempt` (engine/attempts.py); the events read here carry `request_id`, the journey's.
    """

    request_id: str
    worker: "EngineHandle"  # a local WorkerHandle or a remote node
    attempt: str = ""  # the id the worker knows this submission by; empty: request_id
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    tokens_sent: int = 0
    finished: bool = False
    route: Route = Route.CPU  # where the scheduler sent it, and why (auto mode), for the response and the logs
    reason: str = ""
    moved_to: str = ""  # a worker's own stream never moves
    decided_by: str = ""
    handoff: bool = False  # only its prompt runs here (its KV goes on to a decoder): it holds no batch slot

    async def next_event(self):
        event = await self.queue.get()
        if isinstance(event, Delta):
            self.tokens_sent += event.n_tokens
            if event.finish_reason is not None:
                self.finished = True
        elif isinstance(event, (Rejected, Prefilled, WorkerLost, Embedded)):
            self.finished = True
        return event

    def cancel(self) -> None:
        """Stop generating (client gone, timeout); frees the sequence on the worker."""
        if not self.finished:
            self.finished = True
            self.worker.cancel(self.attempt or self.request_id)


class EngineHandle(Protocol):
    name: str  # for logs and the status: "decode0", "node 10.0.0.2:8701"
    spec: EngineSpec  # what it was started with (its role, pool, model, slots)
    error: str  # why it is not ready, "" while it is
    info: dict  # what its engine said of itself at warm-up (cpus, kernels, exact_decode, ...)
    stats: EngineStats  # its engine's latest figures
    restarts: int
    last_heartbeat: float  # when it last said anything (the daemon's watchdog reads it)
    streams: dict[str, WorkerStream]  # by attempt id (engine/attempts.py): what it runs for us
    ready: asyncio.Event  # set while it takes requests

    @property
    def state(self) -> HandleState:
        """Where it is in its lifecycle (engine/lifecycle.py: the states and the moves between them)."""

    @property
    def remote(self) -> bool:
        """True for a node on another host: start-up and the watchdog do not wait for it."""

    @property
    def pid(self) -> int | None:
        """Its process on this host; None for a remote node or a worker not running."""

    @property
    def in_flight(self) -> int:
        """Attempts it holds."""

    @property
    def generating(self) -> int:
        """Attempts that take (or wait for) a batch slot: all but prompts it only hands on."""

    def start(self) -> None: ...

    async def stop(self, timeout: float = 10.0) -> None: ...

    def submit(self, request: GenerateRequest, handling: Handling = ...) -> WorkerStream:
        """Start an attempt; its events arrive on the returned stream."""

    def cancel(self, attempt: str) -> None:
        """Stop an attempt (WorkerStream.cancel); what still arrives of it is dropped."""

    def set_log_level(self, level: str) -> None:
        """The daemon's log level changed (a reload): a local worker takes it when it next starts."""

    def status(self) -> WorkerStatus: ...

    def link_status(self) -> RemoteNodeStatus | None:
        """A remote node's link (address, transfers, its decoders); None for a local worker."""
