"""One request's journey through the engines: one state machine, whichever route it takes.

    prefill ──> handoff ──> decode ──────────────────> done
       │                     │  ▲
       └── (prefill lost) ──>┤  │ (worker lost: queued until a worker of its pool is ready,
                             │  │  then resumed there with the prompt + tokens so far)
                             │  └──┘
                             └──> moved (auto: the rest of an offloaded decode on the GPU) ──> done

A journey starts at prefill (hetero, and auto's offloads) or at decode (the cpu and gpu routes): the
scheduler submits it to a worker as it creates it.

* prefill: hetero and auto offload: the prompt runs on the prefill worker (or the GPU engine), which
  hands its KV record on through the ring.
* handoff: the record is lent to a decoder, which has not answered yet.
* decode: a worker generates (the whole request on the cpu and gpu routes).
* moved: an offloaded decode went back to the GPU engine at a token limit (sysHAX's offload).
* queued: between workers, never at the start: its worker died and it waits (bounded) for a ready one.
* done: finished, refused, failed or cancelled.

A worker that dies is a transition, not the end of the request. Before the request's first token
it is sent again, once (a request that kills its worker before any token may be what kills it:
the supervisor's crash-loop judgement takes over from there). After tokens went out it resumes,
up to MAX_RESUMES times, on a ready worker of the pool it decodes on (waiting, bounded by
request_timeout, for one to be restarted; a decode moved back to the GPU engine goes on on the
CPU, where it was, while that engine restarts): the worker gets the prompt followed by the tokens
generated so far (Handling.resume_tokens), recomputes their KV, and generates the rest.
The client's stream goes on where it was; a greedy request's text is the text of an undisturbed
run (the engine primes its text stream, grammar and penalties with the resumed tokens), exactly where
the workers tile their attention (a prompt pass then gives the resumed tokens' KV the bits their decode
steps gave: engine/exactness.py says where that holds), else but for a near-tie. Each submission is an
attempt of its own (engine/attempts.py), so nothing a cancelled attempt still sends reaches it. A seeded
sampler draws from a fresh generator after a resume, so a seeded request at temperature > 0 is
as valid a sample as any, not the same one; a grammar on the GPU engine (vLLM) cannot start
mid-output, so such a request ends with the error instead.

The journey owns the request's KV record while it is in flight between the engines (the
ledger's record: lent to a decoder, or dropped), and its events reach the API in order through
one queue, fed by one task, so that a wait for a restarted worker survives the API's own
cancellations of its reads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from enum import StrEnum

from syshaxd.engine.decider import Decision
from syshaxd.engine.engine_handle import EngineHandle, EngineUnavailable, WorkerStream
from syshaxd.engine.estimates import Estimates
from syshaxd.engine.kv_ledger import Dropped, KVLedger, Lent, PlanReleased
from syshaxd.sdk.types import (Accepted, Delta, Event, Fallback, GenerateRequest, Handling, Imported, Pool,
                                  Prefilled, Refusal, Rejected, Route, WorkerLost)

log = logging.getLogger(__name__)

MAX_RESUMES = 2  # worker deaths a request survives after its first token


class Stage(StrEnum):
    QUEUED = "queued"
    PREFILL = "prefill"
    HANDOFF = "handoff"
    DECODE = "decode"
    MOVED = "moved"
    DONE = "done"


@dataclass
class JourneyCounts:
    """What journeys survived, over all of them (the scheduler's status and /metrics)."""

    resent: int = 0  # a worker died before the request's first token: sent again
    resumed: int = 0  # a worker died after tokens: resumed on another with the tokens so far
    lost: int = 0  # a worker died and the request could not go on: ended with the error
    reconsidered: int = 0  # auto offload: token limits reached
    moved_to_gpu: int = 0
    move_failed: int = 0  # the decider said "gpu" but no GPU engine could take the rest


@dataclass
class SchedulerCalls:
    """What a journey may ask of the scheduler: workers of a pool, a wait for one, the prefix plan, the decider."""

    # a ready worker of the pool for a request (the least loaded, or the one holding its prefix), or EngineUnavailable
    pick: Callable[..., EngineHandle]
    wait_ready: Callable[[Pool], Awaitable[bool]]  # False: none came back within request_timeout
    # the handling with the request's prefix plan when the worker reads the prefix cache
    with_prefix: Callable[[GenerateRequest, Handling, EngineHandle], Handling] = lambda request, how, worker: how
    decide: Callable[[], Decision] | None = None  # auto mode's decider, for an offloaded decode's token limit
    counts: JourneyCounts = field(default_factory=JourneyCounts)
    estimates: Estimates | None = None  # what requests got (TTFT, TPOT), by side: decider v2 reads it


class Journey:
    """A RequestStream: one request from the scheduler's admission to its last event.

    `route` is where it runs: cpu (a CPU worker does it all), gpu (the GPU engine does it all) or
    hetero (`prefill` runs the prompt, a CPU worker decodes). `token_limit` > 0 makes the decode
    an offloaded one that the decider reconsiders every token_limit tokens. The first submission
    happens here, so that EngineUnavailable reaches the scheduler's caller before any task starts.
    """

    def __init__(self, request: GenerateRequest, route: Route, calls: SchedulerCalls, ledger: KVLedger,
                 prefill: EngineHandle | None = None, reason: str = "", token_limit: int = 0,
                 decided_by: str = "") -> None:
        self.request_id = request.request_id
        self.route, self.reason, self.moved_to = route, reason, ""
        self.decided_by = decided_by  # auto: what placed it (a routing rule, the measurements, the thresholds)
        self.finished = False
        self.tokens_sent = 0
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self._request = request  # what the client asked for (a continuation asks for the rest)
        self._handling = Handling()  # how the worker running it now was told to run it
        self._scheduler = calls
        self._ledger = ledger
        self._pool = Pool.GPU if route == Route.GPU else Pool.CPU  # where it decodes
        self._token_limit = token_limit
        self._next_check = token_limit
        self._generated: list[int] = []
        self._accepted: Accepted | None = None
        self._resent = False
        self._resumes = 0
        self._started = time.monotonic()
        self._first_seen = False  # its first token came (its TTFT was reported)
        self._last_token: float | None = None  # when its latest token came; None after a death: no gap to report
        self.stage: Stage
        if prefill is not None:
            self.stage = Stage.PREFILL
            # a GPU engine in auto mode also generates: handoff asks it for the prompt alone and its KV record
            self._inner: WorkerStream = self._submit(prefill, Handling(handoff=True))
        else:
            self.stage = Stage.DECODE
            self._inner = self._submit(calls.pick(self._pool, request), Handling())
        self._task = asyncio.get_running_loop().create_task(self._run())

    # --- the RequestStream the API reads ---------------------------------------------------------------

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
        self._ledger.tell(Dropped(self.request_id))
        self.stage = Stage.DONE

    # --- the journey ---------------------------------------------------------------------------------

    def _submit(self, worker: EngineHandle, handling: Handling) -> WorkerStream:
        """Send the request to worker with its prefix plan (held for it until the worker reports, or released here
        when the worker cannot take it)."""
        try:
            return worker.submit(self._request, self._scheduler.with_prefix(self._request, handling, worker))
        except EngineUnavailable:
            self._ledger.tell(PlanReleased(self.request_id))
            raise

    def _emit(self, event: Event) -> None:
        if isinstance(event, Delta) and event.finish_reason is not None or isinstance(event, Rejected):
            self.stage = Stage.DONE
        self.queue.put_nowait(event)

    async def _run(self) -> None:
        try:
            if self.stage == Stage.PREFILL:
                await self._prefill()
            if self.stage != Stage.DONE:
                await self._decode()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never leave the client waiting on a stream nobody feeds
            log.exception("%s: the request failed in the daemon", self.request_id)
            self._ledger.tell(Dropped(self.request_id))
            self._emit(Delta(self.request_id, "", 0, "error", f"the request failed in the daemon: {exc}"))

    async def _prefill(self) -> None:
        """prefill -> handoff -> decode: the prompt on the prefill worker, its record lent to a decoder."""
        event = await self._inner.next_event()
        if isinstance(event, WorkerLost):  # before it accepted: the decoder's Accepted goes to the client
            return await self._to_decoder(Handling(kv_missing=Fallback.PREFILL_DIED))
        if not isinstance(event, Accepted):
            return self._emit(event)  # refused (a 400 for the request itself, or unavailable)
        self._accepted = event
        self._emit(event)
        event = await self._inner.next_event()
        if isinstance(event, Prefilled):
            missing = event.reason or Fallback.EXPORT_FAILED if event.handle is None else ""
            self.stage = Stage.HANDOFF
            return await self._to_decoder(Handling(kv=event.handle, kv_missing=missing))
        if isinstance(event, Rejected) and event.kind == Refusal.INVALID:
            return self._emit(event)  # the prompt itself was refused (its grammar has no first token, ...)
        # the prefill worker died, or answered something other than a record
        reason = Fallback.PREFILL_DIED if isinstance(event, WorkerLost) else Fallback.PREFILL_FAILED
        await self._to_decoder(Handling(kv_missing=reason))

    async def _to_decoder(self, handling: Handling) -> None:
        # the prefill worker's prefix plan was done with when it handed on: the decoder recomputes or imports
        self._handling = handling
        try:
            worker = self._scheduler.pick(Pool.CPU)
            self._inner = worker.submit(self._request, handling)
        except EngineUnavailable as exc:
            self._ledger.tell(Dropped(self.request_id))
            return self._emit(Rejected(self.request_id, Refusal.UNAVAILABLE, str(exc), "engine_unavailable"))
        if handling.kv is not None:
            self._ledger.tell(Lent(self.request_id, worker.name))
        self.stage = Stage.HANDOFF if handling.kv is not None else Stage.DECODE

    async def _decode(self) -> None:
        """decode (and moved): forward the worker's output; a worker lost or a token limit is a transition."""
        while True:
            event = await self._inner.next_event()
            if isinstance(event, Imported):  # the ledger heard of it from the worker
                continue
            if isinstance(event, Accepted):
                if self._accepted is None:  # later ones are a resumed or moved continuation's own
                    self._accepted = event
                    self._emit(event)
                continue
            if self.stage == Stage.HANDOFF:
                self.stage = Stage.DECODE  # the decoder answered: the record is its own now
            if isinstance(event, WorkerLost):
                if not await self._lost(event):
                    return
                continue
            if isinstance(event, Rejected) and self.stage == Stage.MOVED and self._generated:
                # the continuation was refused after the client got tokens: end the stream cleanly
                return self._emit(Delta(self.request_id, "", 0, "error",
                                        f"moving the decode to the GPU failed: {event.message}"))
            self._emit(event)
            if isinstance(event, Rejected):
                self._ledger.tell(Dropped(self.request_id))
                return
            if isinstance(event, Delta):
                self._observe(event)
                if event.finish_reason is not None:
                    return
                self._generated.extend(event.tokens)
                if self._token_limit and self.stage == Stage.DECODE and len(self._generated) >= self._next_check:
                    self._reconsider()

    def _observe(self, delta: Delta) -> None:
        """Tell the estimates what this request got: its TTFT by route, each later token's gap by the side that
        decoded it (the GPU engine, or a CPU worker); a gap across a worker's death says nothing of either."""
        estimates = self._scheduler.estimates
        if estimates is None or not delta.n_tokens:
            return
        now = time.monotonic()
        if not self._first_seen:
            self._first_seen = True
            estimates.first_token(self.route, now - self._started)
        elif self._last_token is not None:
            side = "gpu" if self._pool == Pool.GPU or self.stage == Stage.MOVED else "cpu"
            estimates.tokens(side, now - self._last_token, delta.n_tokens)
        self._last_token = now

    async def _lost(self, event: WorkerLost) -> bool:
        """The worker running the request died: go on elsewhere (True), or end the request saying why (False)."""
        counts = self._scheduler.counts
        pool = self._pool  # a decode moved to the GPU engine goes back to the CPU: that engine is restarting
        if event.failed:  # given up on: it will not be back, and its pool may have no other
            return self._end(event, f"the engine worker failed: {event.error}", final=True)
        if event.stopping:
            return self._end(event)
        if not self._generated and not self._resent:
            self._resent = True
            counts.resent += 1
            # the record, if the dead decoder took it, went with it: the next one recomputes the prompt
            self._ledger.tell(Dropped(self.request_id))
            request = self._request
            handling = Handling(kv_missing=Fallback.DECODER_DIED if self._handling.kv is not None else "")
        elif self._generated and self._resumes < MAX_RESUMES and self._resumable(pool):
            self._resumes += 1
            counts.resumed += 1
            request, handling = self._continuation()
        else:
            return self._end(event)
        self._last_token = None  # the wait for a worker is no token's gap
        refused = await self._resubmit(pool, request, handling)
        if refused is not None:
            return self._end(event, str(refused), final=refused.final)
        self._request, self._handling = request, handling
        log.info("%s: its worker %s %s; %s on %s", self.request_id, event.why,
                 f"after {len(self._generated)} tokens" if self._generated else "before its first token",
                 "resumed" if self._generated else "sent again", self._inner.worker.name)
        return True

    def _end(self, event: WorkerLost, why: str = "", final: bool = False) -> bool:
        """End the request over a death it does not survive: a 503 before its first token (nothing was sent:
        the client may retry), an error that ends the answer after."""
        self._scheduler.counts.lost += 1
        self._ledger.tell(Dropped(self.request_id))
        if self._generated:
            during = f"the engine worker {event.why} mid-stream"
            self._emit(Delta(self.request_id, "", 0, "error", f"{during}, and {why}" if why else during))
        elif event.failed:
            self._emit(Rejected(self.request_id, Refusal.UNAVAILABLE, why, "engine_failed"))
        else:
            before = f"the engine worker {event.why} before answering"
            self._emit(Rejected(self.request_id, Refusal.UNAVAILABLE,
                                f"{before}, and {why}" if why else f"{before}; retry the request",
                                "engine_failed" if final else "engine_restarting"))
        return False

    def _resumable(self, pool: Pool) -> bool:
        # vLLM's structured outputs cannot start a grammar mid-output
        return not (self._request.grammar and pool == Pool.GPU)

    def _continuation(self) -> tuple[GenerateRequest, Handling]:
        """The request that generates the rest, and its handling: its prompt, then the tokens generated so far
        (their prompt logprobs went out with the first token)."""
        assert self._accepted is not None  # a resume follows the first token, which follows Accepted
        remaining = self._accepted.max_tokens - len(self._generated)
        return (replace(self._request, prompt_logprobs=None, max_tokens=remaining),
                Handling(resume_tokens=tuple(self._generated)))

    async def _resubmit(self, pool: Pool, request: GenerateRequest, handling: Handling) -> EngineUnavailable | None:
        """Send request to a ready worker of pool, waiting (bounded) for one to come back; None when it went,
        else why not."""
        stage, self.stage = self.stage, Stage.QUEUED
        try:
            try:
                self._inner = self._scheduler.pick(pool).submit(request, handling)
            except EngineUnavailable as exc:
                # none ready: its own worker is restarting (perhaps with safer kernels); wait for it, bounded
                if exc.final or not await self._scheduler.wait_ready(pool):
                    raise
                self._inner = self._scheduler.pick(pool).submit(request, handling)
        except EngineUnavailable as exc:
            self.stage = stage
            return exc
        self.stage = Stage.DECODE
        return None

    def _reconsider(self) -> None:
        """auto: decide again at the token limit; move the rest of the decode to the GPU engine when it has room."""
        counts = self._scheduler.counts
        counts.reconsidered += 1
        assert self._scheduler.decide is not None  # only auto reconsiders, and auto's scheduler gives its decider
        decision = self._scheduler.decide()
        # a grammar-constrained decode stays: vLLM's structured outputs cannot start a grammar mid-output
        if decision.route != Route.GPU or self._accepted is None or self._request.grammar:
            self._next_check = len(self._generated) + (decision.token_limit or self._token_limit)
            return
        continuation, handling = self._continuation()
        try:
            stream = self._scheduler.pick(Pool.GPU).submit(continuation, handling)
        except EngineUnavailable as exc:
            counts.move_failed += 1
            log.info("%s: staying on the CPU (%s)", self.request_id, exc)
            self._next_check = len(self._generated) + self._token_limit
            return
        self._inner.cancel()  # frees the CPU sequence; its in-flight tokens are dropped with it
        self._last_token = None  # the move's recompute is no decode step's gap
        self._inner = stream
        self._request, self._handling = continuation, handling
        self.stage, self.moved_to = Stage.MOVED, Route.GPU
        counts.moved_to_gpu += 1
        log.info("%s: decode moves back to the GPU after %d tokens on the CPU (%s)", self.request_id,
                 len(self._generated), decision.reason)
