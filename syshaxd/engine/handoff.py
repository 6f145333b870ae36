"""One hetero request: prefill on the prefill worker, KV through the ring, decode on a CPU worker."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from syshaxd.engine.supervisor import EngineUnavailable
from syshaxd.engine.types import Accepted, Delta, GenerateRequest, Imported, Prefilled, Rejected

if TYPE_CHECKING:
    from syshaxd.engine.scheduler import Scheduler
    from syshaxd.engine.supervisor import WorkerHandle

log = logging.getLogger(__name__)


class HandoffStream:
    """Looks to the API like a worker's RequestStream: next_event(), cancel(), finished.

    The prefill worker's Accepted goes to the client as is; its Prefilled (the ring handle)
    goes with the request to the least loaded decode worker, whose events follow. Whatever
    fails on the way — ring full, a bad record, either worker dying before the first token —
    the request continues on a decoder that recomputes the prompt: slower, never lost.
    """

    def __init__(self, scheduler: "Scheduler", request: GenerateRequest, prefill: "WorkerHandle") -> None:
        self.request_id = request.request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self.tokens_sent = 0
        self._scheduler = scheduler
        self._request = request
        self.route, self.reason = "hetero", ""
        # a GPU engine in auto mode also generates: handoff asks it for the prompt alone and its KV record
        self._inner = prefill.submit(replace(request, handoff=True))  # raises EngineUnavailable before any task
        self._handle = None  # the ring record while nobody has taken it
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def next_event(self):
        event = await self.queue.get()
        if isinstance(event, Delta):
            self.tokens_sent += event.n_tokens
            self.finished = self.finished or event.finish_reason is not None
        elif isinstance(event, Rejected):
            self.finished = True
        return event

    @property
    def handle(self):
        """The ring record this request holds and no decoder has taken yet, if any."""
        return self._handle

    def cancel(self) -> None:
        if self.finished:
            return
        self.finished = True
        self._task.cancel()
        self._inner.cancel()
        self._drop_record()

    def _drop_record(self) -> None:
        if self._handle is not None:
            self._scheduler.release_record(self._handle)
            self._handle = None

    async def _run(self) -> None:
        try:
            await self._flow()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never leave the client waiting on a stream nobody feeds
            log.exception("%s: hetero handoff failed", self.request_id)
            self.queue.put_nowait(Delta(self.request_id, "", 0, "error", f"handoff failed: {exc}"))

    async def _flow(self) -> None:
        stats = self._scheduler.handoff
        event = await self._inner.next_event()
        if not isinstance(event, Accepted):
            if isinstance(event, Rejected) and event.code == "engine_restarting":
                return await self._decode(replace(self._request, kv_missing="prefill_died"), forward_accept=True)
            self.queue.put_nowait(event)
            return
        self.queue.put_nowait(event)
        event = await self._inner.next_event()
        if isinstance(event, Prefilled):
            self._handle = event.handle
            request = replace(self._request, kv=event.handle, kv_missing=event.reason if event.handle is None else "")
            if event.handle is not None:
                stats["records_written"] += 1
                stats["bytes_written"] += event.handle.length
            return await self._decode(request, prefilled_at=time.monotonic())
        # the prefill worker died (or failed) before handing over
        reason = "prefill_died" if isinstance(event, (Rejected, Delta)) else "prefill_failed"
        await self._decode(replace(self._request, kv_missing=reason))

    async def _decode(self, request: GenerateRequest, forward_accept: bool = False,
                      prefilled_at: float | None = None) -> None:
        stats = self._scheduler.handoff
        forwarded = 0
        for attempt in range(2):
            try:
                worker = self._scheduler.pick_decoder()
                self._inner = worker.submit(request)
            except EngineUnavailable as exc:
                self._drop_record()
                self.queue.put_nowait(Rejected(self.request_id, 503, str(exc), "engine_unavailable"))
                return
            event = await self._inner.next_event()
            if isinstance(event, Accepted):
                if forward_accept:
                    self.queue.put_nowait(event)
            elif isinstance(event, Rejected) and event.code == "engine_restarting" and attempt == 0:
                request = replace(request, kv=None, kv_missing="decoder_died")  # that worker took the record
                self._drop_record()
                continue
            else:
                self._drop_record()
                self.queue.put_nowait(event)
                return
            while True:
                event = await self._inner.next_event()
                if isinstance(event, Imported):
                    self._handle = None  # the decoder read and released it, used or not
                    if event.ok:
                        stats["records_read"] += 1
                        if prefilled_at is not None:
                            stats["latency"].append(time.monotonic() - prefilled_at)
                    else:
                        stats["fallbacks"][event.reason] += 1
                        if event.reason not in ("ring_full",) and request.kv is not None:
                            stats["records_failed"] += 1
                    continue
                if isinstance(event, Rejected) and event.code == "engine_restarting" and forwarded == 0 \
                        and attempt == 0:
                    request = replace(request, kv=None, kv_missing="decoder_died")
                    self._drop_record()
                    break  # no token went out yet: retry on another decoder
                if isinstance(event, Delta):
                    forwarded += event.n_tokens
                self.queue.put_nowait(event)
                if isinstance(event, Rejected) or (isinstance(event, Delta) and event.finish_reason):
                    return
