"""What the scheduler holds for each engine it sends requests to: the EngineHandle protocol.

Two classes implement it: a worker process of this host (engine/supervisor.py: WorkerHandle, which runs
prefill, decode or both) and a decode node on another host (remote/front.py: RemoteNode, one more CPU decoder
with the slots of all the node's decoders). The scheduler, the journeys and the status read only what is
declared here, so a remote node is never a WorkerHandle in disguise: mypy checks both against this protocol
wherever the daemon puts them in its list (tests/test_types.py runs it).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Protocol

from syshaxd.engine.lifecycle import HandleState
from syshaxd.sdk.types import EngineSpec, EngineStats, GenerateRequest, Handling

if TYPE_CHECKING:
    from syshaxd.engine.status import RemoteNodeStatus, WorkerStatus
    from syshaxd.engine.supervisor import WorkerStream


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
