"""A request on one worker that goes on on another when its worker dies before its first token."""

from __future__ import annotations

import logging
from collections.abc import Callable

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
                 again: Callable[[GenerateRequest], GenerateRequest] = lambda request: request) -> None:
        self.request_id = request.request_id
        self.route, self.reason, self.moved_to = Route.CPU, "", ""
        self.finished = False
        self.tokens_sent = 0
        self._request = request
        self._inner = first
        self._pick = pick
        self._again = again
        self._retried = False
        self._accepted = False

    async def next_event(self) -> Event:
        while True:
            event = await self._inner.next_event()
            if isinstance(event, Rejected) and event.code == "engine_restarting" and not self.tokens_sent \
                    and not self._retried and self._resend():
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

    def _resend(self) -> bool:
        self._retried = True
        self._request = self._again(self._request)
        try:
            self._inner = self._pick().submit(self._request)
        except EngineUnavailable as exc:
            log.info("%s: its worker died before the first token and no other can take it (%s)", self.request_id,
                     exc)
            return False
        log.info("%s: its worker died before the first token; sent again to %s", self.request_id,
                 self._inner.worker.name)
        return True

    def cancel(self) -> None:
        if not self.finished:
            self.finished = True
            self._inner.cancel()
