"""An auto-mode request whose decode was offloaded to the CPU, reconsidered every token_limit tokens.

sysHAX's token limit: a decode moved to the CPU because the GPU was saturated should not stay
there for good. Every `token_limit` generated tokens the scheduler decides again; when the GPU
engine has room by then, the decode moves back: the GPU engine gets the prompt followed by the
tokens generated so far (``GenerateRequest.resume_tokens``), recomputes their KV in one prefill
(what it is fast at), and generates the rest; the CPU sequence is cancelled. The client sees
one stream: the continuation's own Accepted is swallowed and its text continues where the CPU
left off (the engine primes its text stream with the resumed tokens, so a stop string or a
UTF-8 character split across the move still comes out right).

Penalties (presence, frequency, repetition) restart their counts on the new engine, and a
seeded sample draws from a fresh generator: a moved request is as valid a sample as any, not
the same sample it would have been without the move.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING

from syshaxd.engine.supervisor import EngineUnavailable
from syshaxd.engine.types import Accepted, Delta, GenerateRequest, Rejected

if TYPE_CHECKING:
    from syshaxd.engine.scheduler import Scheduler

log = logging.getLogger(__name__)


class OffloadStream:
    """Looks to the API like a RequestStream (next_event, cancel, finished, tokens_sent)."""

    def __init__(self, scheduler: "Scheduler", request: GenerateRequest, inner, token_limit: int) -> None:
        self.request_id = request.request_id
        self.route, self.reason = "hetero", ""
        self.moved_to = ""  # "gpu" once the decode moved back
        self.finished = False
        self.tokens_sent = 0
        self._scheduler = scheduler
        self._request = request
        self._inner = inner
        self._token_limit = token_limit
        self._next_check = token_limit
        self._generated: list[int] = []
        self._accepted: Accepted | None = None

    async def next_event(self):
        while True:
            event = await self._inner.next_event()
            if isinstance(event, Accepted):
                if self._accepted is not None:
                    continue  # the continuation's; the client already has the request's own
                self._accepted = event
                return event
            if isinstance(event, Delta):
                self._generated.extend(event.tokens)
                self.tokens_sent += event.n_tokens
                if event.finish_reason is not None:
                    self.finished = True
                elif not self.moved_to and len(self._generated) >= self._next_check:
                    self._reconsider()
                return event
            if isinstance(event, Rejected):
                if self.moved_to and self._generated:
                    # the continuation was refused after the client got tokens: end the stream cleanly
                    self.finished = True
                    return Delta(self.request_id, "", 0, "error", f"moving the decode to the GPU failed: "
                                 f"{event.message}")
                self.finished = True
            return event

    def cancel(self) -> None:
        if not self.finished:
            self.finished = True
            self._inner.cancel()

    def _reconsider(self) -> None:
        """Decide again; move the rest of the decode to the GPU engine when it has room now."""
        scheduler = self._scheduler
        scheduler.auto["reconsidered"] += 1
        decision = scheduler.decide()
        if decision.route != "gpu" or self._accepted is None:
            self._next_check = len(self._generated) + (decision.token_limit or self._token_limit)
            return
        remaining = self._accepted.max_tokens - len(self._generated)
        continuation = replace(self._request, kv=None, kv_missing="", handoff=False, route="gpu",
                               resume_tokens=tuple(self._generated), max_tokens=remaining)
        try:
            stream = scheduler.pick_gpu().submit(continuation)
        except EngineUnavailable as exc:
            scheduler.auto["move_failed"] += 1
            log.info("%s: staying on the CPU (%s)", self.request_id, exc)
            self._next_check = len(self._generated) + self._token_limit
            return
        self._inner.cancel()  # frees the CPU sequence; its in-flight tokens are dropped with it
        self._inner = stream
        self.moved_to = "gpu"
        scheduler.auto["moved_to_gpu"] += 1
        log.info("%s: decode moves back to the GPU after %d tokens on the CPU (%s)", self.request_id,
                 len(self._generated), decision.reason)
