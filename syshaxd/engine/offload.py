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
from collections.abc import Callable
from dataclasses import dataclass, replace

from syshaxd.engine.decider import Decision, Verdict
from syshaxd.engine.supervisor import EngineUnavailable, WorkerHandle
from syshaxd.engine.types import Accepted, Delta, Event, GenerateRequest, Rejected, RequestStream, Route

log = logging.getLogger(__name__)


@dataclass
class OffloadCounts:
    """What offloaded decodes did, over all of them (auto mode's status and /metrics)."""

    reconsidered: int = 0  # token limits reached
    moved_to_gpu: int = 0
    move_failed: int = 0  # the decider said "gpu" but no GPU engine could take the rest


class OffloadStream:
    """A RequestStream around an offloaded decode (a HandoffStream, or a CPU worker's own stream)."""

    def __init__(self, request: GenerateRequest, inner: RequestStream, token_limit: int,
                 decide: Callable[[], Decision], pick_gpu: Callable[[], WorkerHandle], counts: OffloadCounts) -> None:
        self.request_id = request.request_id
        self.route, self.reason = Route.HETERO, ""
        self.moved_to = ""  # Route.GPU once the decode moved back
        self.finished = False
        self.tokens_sent = 0
        self._decide = decide
        self._pick_gpu = pick_gpu
        self._counts = counts
        self._request = request
        self._inner = inner
        self._token_limit = token_limit
        self._next_check = token_limit
        self._generated: list[int] = []
        self._accepted: Accepted | None = None

    async def next_event(self) -> Event:
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
        self._counts.reconsidered += 1
        decision = self._decide()
        # a grammar-constrained decode stays: vLLM's structured outputs cannot start a grammar mid-output
        if decision.route != Verdict.GPU or self._accepted is None or self._request.grammar:
            self._next_check = len(self._generated) + (decision.token_limit or self._token_limit)
            return
        remaining = self._accepted.max_tokens - len(self._generated)
        continuation = replace(self._request, kv=None, kv_missing="", handoff=False, route=Route.GPU,
                               resume_tokens=tuple(self._generated), max_tokens=remaining)
        try:
            stream = self._pick_gpu().submit(continuation)
        except EngineUnavailable as exc:
            self._counts.move_failed += 1
            log.info("%s: staying on the CPU (%s)", self.request_id, exc)
            self._next_check = len(self._generated) + self._token_limit
            return
        self._inner.cancel()  # frees the CPU sequence; its in-flight tokens are dropped with it
        self._inner = stream
        self.moved_to = Route.GPU
        self._counts.moved_to_gpu += 1
        log.info("%s: decode moves back to the GPU after %d tokens on the CPU (%s)", self.request_id,
                 len(self._generated), decision.reason)
