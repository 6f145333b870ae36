"""One hetero request: prefill on the prefill worker, KV through the ring, decode on a CPU worker."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import replace

from syshaxd.engine.kv_ledger import KVLedger
from syshaxd.engine.retry import RetryStream
from syshaxd.engine.supervisor import EngineUnavailable, WorkerHandle
from syshaxd.engine.types import (Accepted, Delta, Event, Fallback, GenerateRequest, Imported, Prefilled, Rejected,
                                  Route)

log = logging.getLogger(__name__)


class HandoffStream:
    """A RequestStream over two workers.

    The prefill worker's Accepted goes to the client as is; its Prefilled (the ring handle)
    goes with the request to the least loaded decode worker (`pick_decoder`), whose events follow.
    Whatever fails on the way — ring full, a bad record, either worker dying before the first
    token — the request continues on a decoder that recomputes the prompt: slower, never lost.
    The record belongs to the ledger: this stream lends it to the decoder, or drops it.
    """

    def __init__(self, request: GenerateRequest, prefill: WorkerHandle, ledger: KVLedger,
                 pick_decoder: Callable[[], WorkerHandle]) -> None:
        self.request_id = request.request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self.tokens_sent = 0
        self.route, self.reason, self.moved_to = Route.HETERO, "", ""
        self._request = request
        self._ledger = ledger
        self._pick_decoder = pick_decoder
        # a GPU engine in auto mode also generates: handoff asks it for the prompt alone and its KV record
        self._inner = prefill.submit(replace(request, handoff=True))  # raises EngineUnavailable before any task
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def next_event(self) -> Event:
        event = await self.queue.get()
        if isinstance(event, Delta):
            self.tokens_sent += event.n_tokens
            self.finished = self.finished or event.finish_reason is not None
        elif isinstance(event, Rejected):
            self.finished = True
        return event

    def cancel(self) -> None:
        if self.finished:
            return
        self.finished = True
        self._task.cancel()
        self._inner.cancel()
        self._ledger.drop(self.request_id)

    async def _run(self) -> None:
        try:
            await self._flow()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never leave the client waiting on a stream nobody feeds
            log.exception("%s: hetero handoff failed", self.request_id)
            self._ledger.drop(self.request_id)
            self.queue.put_nowait(Delta(self.request_id, "", 0, "error", f"handoff failed: {exc}"))

    async def _flow(self) -> None:
        event = await self._inner.next_event()
        if not isinstance(event, Accepted):
            if isinstance(event, Rejected) and event.code == "engine_restarting":
                return await self._decode(replace(self._request, kv_missing=Fallback.PREFILL_DIED),
                                          forward_accept=True)
            self.queue.put_nowait(event)
            return
        self.queue.put_nowait(event)
        event = await self._inner.next_event()
        if isinstance(event, Prefilled):
            missing = event.reason or Fallback.EXPORT_FAILED if event.handle is None else ""
            return await self._decode(replace(self._request, kv=event.handle, kv_missing=missing))
        # the prefill worker died (or failed) before handing over
        reason = Fallback.PREFILL_DIED if isinstance(event, (Rejected, Delta)) else Fallback.PREFILL_FAILED
        await self._decode(replace(self._request, kv_missing=reason))

    async def _decode(self, request: GenerateRequest, forward_accept: bool = False) -> None:
        """Run the decode on a CPU worker (on another, recomputing, if the first dies before its first token)."""
        request = replace(request, prefix=None)  # the prefill worker's plan, done with when it handed on
        try:
            worker = self._pick_decoder()
            first = worker.submit(request)
        except EngineUnavailable as exc:
            self._ledger.drop(self.request_id)
            self.queue.put_nowait(Rejected(self.request_id, 503, str(exc), "engine_unavailable"))
            return
        if request.kv is not None:
            self._ledger.lend(self.request_id, worker.name)
        self._inner = RetryStream(request, first, self._pick_decoder, again=self._without_record)
        while True:
            event = await self._inner.next_event()
            if isinstance(event, Imported):  # the ledger heard of it from the worker
                continue
            if isinstance(event, Accepted):
                if forward_accept:  # the prefill worker died before the client had one
                    self.queue.put_nowait(event)
                continue
            self.queue.put_nowait(event)
            if isinstance(event, Rejected):
                self._ledger.drop(self.request_id)
                return
            if isinstance(event, Delta) and event.finish_reason:
                return

    def _without_record(self, sent: GenerateRequest) -> GenerateRequest:
        """What goes to a second decoder: the first died before its first token, and the record (if it took
        it) went with it."""
        self._ledger.drop(self.request_id)
        return replace(sent, kv=None, kv_missing=Fallback.DECODER_DIED)
