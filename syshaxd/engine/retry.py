"""A request on one worker that goes on on another when its worker dies before its first token."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from syshaxd.engine.supervisor import EngineUnavailable, WorkerHandle, WorkerStream
from syshaxd.engine.types import Accepted, Delta, Event, GenerateRequest, Rejected, Route

log = logging.getLogger(__name__)


class RetryStream:
    """A RequestStream on one worker of a pool: if that worker dies (or its pipe breaks) before the request's
    first token, the request is sent once more to another ready worker of the pool, so the client never
    sees the death. After a token went out, a death ends the stream with an error as before: the text
    cannot be taken back. The cpu and gpu routes use it as it is; a hetero decode gives `again`, which
    makes the request sent the second time (without the KV record the dead decoder took).
    """

    def __init__(self, request: GenerateRequest, first: WorkerStream, pick: Callable[[], WorkerHandle],
                 again: Callable[[GenerateRequest], GenerateRequest] = lambda request: request,
                 wait_ready: Callable[[], Awaitable[bool]] | None = None) -> None:
        self.request_id = request.request_id
        self.route, self.reason, self.moved_to = Route.CPU, "", ""
        self.finished = False
        self.tokens_sent = 0
        self._request = request
        self._inner = first
        self._pick = pick
        self._again = again
        self._wait_ready = wait_ready  # when no worker is ready: wait (bounded) for one to come back
        self._retried = False
        self._resending = False  # its worker died before its first token: being sent again
        self._accepted = False

    async def next_event(self) -> Event:
        # The API waits for each event in slices (it cancels this call every second to look for a client that
        # left), so a wait for a restarted worker must survive being cancelled: it is state (_resending), and
        # the next call takes it up again.
        while True:
            if self._resending:
                refused = await self._resend()
                self._resending = False
                if refused is not None:
                    self.finished = True
                    return Rejected(self.request_id, 503, f"the engine worker stopped before answering, and {refused}",
                                    "engine_failed" if refused.final else "engine_restarting")
            event = await self._inner.next_event()
            if isinstance(event, Rejected) and event.code == "engine_restarting" and not self.tokens_sent \
                    and not self._retried:
                self._retried = True
                self._request = self._again(self._request)
                self._resending = True
                continue
            if isinstance(event, Accepted):
                if self._accepted:
                    continue  # the retry's own; the client has the first
                self._accepted = True
            elif isinstance(event, Delta):
                self.tokens_sent += event.n_tokens
                self.finished = self.finished or event.finish_reason is not None
            elif isinstance(event, Rejected):
                self.finished = True
            return event

    async def _resend(self) -> EngineUnavailable | None:
        """Send the request again; None when it went, else why it could not."""
        try:
            self._inner = self._pick().submit(self._request)
        except EngineUnavailable as exc:
            # none ready: its own worker is restarting (perhaps with safer kernels); wait for it, bounded
            if self._wait_ready is None or not await self._wait_ready():
                log.info("%s: its worker died before the first token and no other can take it (%s)",
                         self.request_id, exc)
                return exc
            try:
                self._inner = self._pick().submit(self._request)
            except EngineUnavailable as again:
                return again
        log.info("%s: its worker died before the first token; sent again to %s", self.request_id,
                 self._inner.worker.name)
        return None

    def cancel(self) -> None:
        if not self.finished:
            self.finished = True
            self._inner.cancel()
