"""Owns every request's route -- cpu, gpu, hetero, or auto (sysHAX's PD offload) -- and what the daemon admits."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, replace

from syshaxd.config import MODES, Config, Mode
from syshaxd.engine import capabilities
from syshaxd.engine.decider import Decision, EngineState, Targets, Thresholds, decide, decide_measured
from syshaxd.engine.engine_handle import EngineHandle, EngineUnavailable
from syshaxd.engine.entry_models import EntryModels
from syshaxd.engine.estimates import Estimates
from syshaxd.engine.exactness import exactness
from syshaxd.engine.journey import Journey, JourneyCounts, SchedulerCalls
from syshaxd.engine.kv_ledger import KVLedger, WentWithout
from syshaxd.engine.lifecycle import HandleState
from syshaxd.engine.prefix_routing import PrefixRouting
from syshaxd.engine.prompts import DaemonVocab, PromptTokenizer
from syshaxd.engine.status import AutoDecision, AutoStatus, SchedulerStatus
from syshaxd.routing_rules import RoutingRule
from syshaxd.sdk.plugins import backend_capabilities
from syshaxd.sdk.types import Fallback, GenerateRequest, Handling, Pool, Rejected, RequestStream, Route

log = logging.getLogger(__name__)


class Overloaded(RuntimeError):
    """Every batch slot and queue place is taken; the client should retry later (429)."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RouteUnavailable(ValueError):
    """The request asked for a route this daemon was not started for (400)."""


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

    def __init__(self, config: Config, workers: list[EngineHandle], ledger: KVLedger | None = None,
                 prompts: PromptTokenizer | None = None) -> None:
        self.config = config
        self.workers = workers
        # what each worker's backend declares it can do: the front door refuses by it (engine/capabilities.py)
        self.capabilities = backend_capabilities({w.spec.backend for w in workers})
        # the daemon's one copy of the vocabulary (the engines' GGUF: every worker serves the same model), which
        # renders and tokenizes every prompt once, before any engine sees it
        self.prompts = prompts or PromptTokenizer(DaemonVocab(workers[0].spec.model_path if workers else ""),
                                                  config.n_ctx)
        self.vocab = self.prompts.vocab
        self.pools = {pool: [w for w in workers if w.spec.pool == pool] for pool in Pool}
        self.model_file: dict = {}  # the daemon's LoadPlan of the GGUF, for the status
        self.entries = EntryModels([])  # the models of [[models]] beside the chat model (the daemon sets its own)
        self.decoders = self.pools[Pool.CPU]
        self.prefill = self.pools[Pool.PREFILL]
        self.gpu = self.pools[Pool.GPU]
        self.ledger = ledger or KVLedger()  # the KV records in the ring; the workers report to the same one
        self.routes: Counter = Counter()
        self.refused: Counter = Counter()
        self.decisions: Counter = Counter()
        self.decided_by: Counter = Counter()  # what placed auto requests: rule:NAME, measured, thresholds, ...
        self.rules_matched: Counter = Counter()  # routing rules that matched a request ...
        self.rules_without_room: Counter = Counter()  # ... and those whose device had no room then (soft)
        self.queued_for_gpu = 0
        self.journeys = JourneyCounts()  # what requests survived (a worker's death) and did (auto's moves)
        self.estimates = Estimates()  # what requests got on each side, for decider v2
        self.prefix_routing = PrefixRouting()  # which engine of a pool was sent which prompt blocks
        self._pids: dict[str, int | None] = {}  # each worker's process when last picked: a new one forgot its cache
        self.calls = SchedulerCalls(pick=self.pick, wait_ready=lambda pool: self.wait_ready(self.pools[pool]),
                                    with_prefix=self._with_prefix, decide=self.decide, counts=self.journeys,
                                    estimates=self.estimates)
        self.last_decision: AutoDecision | None = None
        self._unservable = self._why_unservable()  # the pools never change: worked out once, read per request

    @property
    def mode(self) -> str:
        return self.config.mode

    @property
    def model_name(self) -> str:
        """The model this daemon serves (every worker serves the same)."""
        return self.workers[0].spec.model_name if self.workers else ""

    # --- what this daemon can serve -----------------------------------------------------------

    def servable_modes(self) -> dict[str, str]:
        """Each mode, and why this daemon cannot route to it ("" when it can)."""
        return dict(self._unservable)

    def _why_unservable(self) -> dict[str, str]:
        restart = "; set mode = \"{}\" in the config file (syshax config set mode {} --save) and restart syshaxd"
        exports = any(w.spec.ring for w in self.gpu)
        why: dict[str, str] = {}
        why[Mode.CPU] = "" if self.decoders else "this daemon has no CPU workers (gpu mode)" + restart.format(
            "auto", "auto")
        why[Mode.GPU] = "" if self.gpu else "this daemon has no GPU engine" + restart.format("gpu", "gpu")
        if not self.decoders or not (self.prefill or exports):
            why[Mode.HETERO] = "this daemon has no prefill engine, CPU decoders and KV ring" + restart.format(
                "hetero", "hetero")
        else:
            why[Mode.HETERO] = ""
        if not (self.gpu and exports and self.decoders):
            why[Mode.AUTO] = "auto needs the GPU engine, CPU decoders and the KV ring between them" + restart.format(
                "auto", "auto")
        else:
            why[Mode.AUTO] = ""
        return why

    def set_mode(self, mode: str) -> None:
        """The default route of new requests; raises ValueError when this daemon cannot serve it."""
        if mode not in MODES:
            raise ValueError(f"mode: must be one of {', '.join(MODES)}; got {mode!r}")
        reason = self._unservable[mode]
        if reason:
            raise ValueError(f"mode {mode!r} is not available: {reason}")
        self.config = self.config.replace(mode=Mode(mode))

    def is_ready(self) -> bool:
        """The daemon's own model serves (engines_ready), and the [[models]] entries loaded at start have."""
        return self.engines_ready() and self.entries.is_ready()

    def engines_ready(self) -> bool:
        """Every worker of this host is ready, and a decoder (of this host or a remote node) where there are any:
        a remote node that is down costs capacity, not readiness, while another decoder serves."""
        local = [w for w in self.workers if not w.remote]
        return bool(self.workers) and all(w.state == HandleState.READY for w in local) and (
            not self.decoders or any(w.state == HandleState.READY for w in self.decoders))

    # --- admission ----------------------------------------------------------------------------

    def slots(self, pool: Pool) -> int:
        return sum(w.spec.max_batch_size for w in self.pools[pool] if w.state == HandleState.READY)

    def capacity(self) -> int:
        """Requests the daemon holds at once: every batch slot of the CPU and GPU engines plus the queue."""
        return self.slots(Pool.CPU) + self.slots(Pool.GPU) + self.config.max_queue_size

    def in_flight(self) -> int:
        return sum(w.in_flight for w in self.workers)

    def queued(self) -> int:
        """Requests admitted beyond the engines' batch slots: they wait in an engine's queue."""
        return max(0, sum(w.generating for w in self.workers) - self.slots(Pool.CPU) - self.slots(Pool.GPU))

    @classmethod
    def _least_loaded(cls, workers: list[EngineHandle], what: str) -> EngineHandle:
        ready = [w for w in workers if w.state == HandleState.READY]
        if not ready:
            raise cls._unready(workers, f"no {what}")
        return min(ready, key=lambda w: w.in_flight)

    @classmethod
    def _unready(cls, workers: list[EngineHandle], what: str) -> EngineUnavailable:
        """Why none of `workers` can take a request: retry shortly, unless every one of them failed for good."""
        if workers and all(w.state == HandleState.FAILED for w in workers):
            return EngineUnavailable(f"{what} can serve: {cls._states(workers)}", final=True)
        return EngineUnavailable(f"{what} is ready ({cls._states(workers)}); retry shortly")

    async def wait_ready(self, workers: list[EngineHandle]) -> bool:
        """Wait, up to request_timeout, until one of `workers` is ready; False when that did not happen (each
        failed for good, or the time ran out). A request whose worker died before its first token waits here
        for the worker's restart rather than fail at once."""
        deadline = time.monotonic() + self.config.request_timeout
        while time.monotonic() < deadline:
            if any(w.state == HandleState.READY for w in workers):
                return True
            if all(w.state in (HandleState.FAILED, HandleState.STOPPED) for w in workers):
                return False
            await asyncio.sleep(0.1)
        return False

    def pick(self, pool: Pool, request: GenerateRequest | None = None) -> EngineHandle:
        """A ready worker of pool (CPU: the decoders; GPU: the GPU engines) for request: the least loaded, or in a
        pool of engines with their own prefix caches the one holding the request's prefix (engine/prefix_routing)."""
        workers = self.pools[pool]
        least = self._least_loaded(workers, "GPU engine" if pool == Pool.GPU else "CPU worker")
        return self._by_prefix([w for w in workers if w.state == HandleState.READY], request) or least

    def _by_prefix(self, ready: list[EngineHandle], request: GenerateRequest | None) -> EngineHandle | None:
        """The engine holding the request's prompt prefix, where the engines keep their own prefix caches; None:
        placement by load alone."""
        if (request is None or request.prompt_tokens is None or len(ready) < 2 or not self.config.prefix_routing
                or not all(self.capabilities[w.spec.backend].own_prefix_cache for w in ready)):
            return None
        for w in ready:
            if self._pids.get(w.name, w.pid) != w.pid:
                self.prefix_routing.forget(w.name)  # restarted: what it held is gone
            self._pids[w.name] = w.pid
        return self.prefix_routing.choose(ready, request.prompt_tokens)

    async def prepare(self, choices: Sequence[GenerateRequest], n: int = 1) -> list[GenerateRequest] | Rejected:
        """The choices as they should be submitted: each prompt rendered and tokenized once, here (choices come n
        to a prompt, in order), so that the engines get token ids and the prefix cache can be planned; a Rejected
        (an engine's own answer) when a prompt cannot run."""
        prepared: list[GenerateRequest] = []
        for first in range(0, len(choices), n):
            tokenized = await self.prompts.tokenize(choices[first], self.config.default_max_tokens)
            if isinstance(tokenized, Rejected):
                return tokenized
            if choices[first].cache_prompt and choices[first].prompt_logprobs is None:
                await self.ledger.prefix_from_disk(tokenized.prompt_tokens)  # its blocks only the disk still holds
            prepared += [replace(choice, prompt_tokens=tokenized.prompt_tokens, max_tokens=tokenized.max_tokens,
                                 max_tokens_default=tokenized.max_tokens_default, prompt=None, messages=None,
                                 chat_template_kwargs=None)
                         for choice in choices[first:first + n]]
        return prepared

    def _with_prefix(self, request: GenerateRequest, handling: Handling, worker: EngineHandle) -> Handling:
        """The handling with the request's prefix plan when `worker` reads the prefix cache; the plan's blocks are
        held for the request until the worker reports on them or the request's stream there ends."""
        if (request.prompt_tokens is None or not request.cache_prompt or handling.resume_tokens
                or request.prompt_logprobs is not None  # every prompt position's logits: the prompt runs whole
                or not worker.info.get("prefix_cache")):
            return handling
        # a worker that proved its decode steps give a prompt chunk's bits keeps what the request generates
        generate = (request.max_tokens or 0) if worker.info.get("keeps_generated") else 0  # prepare() set it
        plan = self.ledger.plan_prefix(request.request_id, request.prompt_tokens, generate)
        return replace(handling, prefix=plan) if plan is not None else handling

    def servable(self, mode: str) -> None:
        """Raises RouteUnavailable when this daemon cannot serve route `mode`, EngineUnavailable when no engine
        of it is ready now."""
        if mode not in MODES:
            raise RouteUnavailable(f"route {mode!r} is not one of {', '.join(MODES)}")
        why = self._unservable[mode]
        if why:
            raise RouteUnavailable(f"this daemon cannot serve route {mode!r}: {why}")
        needed = self.gpu if mode == Mode.GPU else self.decoders
        if not any(w.state == HandleState.READY for w in needed):
            self.refused["unavailable"] += 1
            raise self._unready(needed, "no engine")

    def check_capabilities(self, request: GenerateRequest, route: str = "") -> None:
        """Raises as servable does for the route (a mode for this request alone; "": the daemon's), or
        capabilities.Unsupported when the request asks an engine on its way for what that engine's backend lacks."""
        mode = route or self.mode
        self.servable(mode)
        capabilities.check(request, mode, self._way(mode, request))

    def _stop(self, pool: list[EngineHandle], hands_on: bool = False) -> list[capabilities.Stop]:
        # a pool of engines of several backends (prefill_engine = "vllm,torch"): what any of them lacks is refused,
        # as the request may meet any one
        backends = dict.fromkeys(w.spec.backend for w in pool)
        return [capabilities.Stop(b, self.capabilities[b], hands_on) for b in backends]

    def _way(self, mode: str, request: GenerateRequest) -> list[capabilities.Stop]:
        """The engines a request may visit on route `mode`: the one that prefills and hands on, then a decoder;
        or the one that does it all. Auto may take either way (or the CPU alone while the GPU engine is not
        ready), so it checks every engine it may meet."""
        if mode == Mode.CPU:
            return self._stop(self.decoders)
        if mode == Mode.GPU:
            return self._stop(self.gpu)
        if mode == Mode.HETERO:
            return self._stop(self.prefill or self.gpu, hands_on=True) + self._stop(self.decoders)
        if self._runs_on_cpu_for_logprobs(request):
            return self._stop(self.decoders)
        return self._stop(self.gpu, hands_on=True) + self._stop(self.decoders)

    def _runs_on_cpu_for_logprobs(self, request: GenerateRequest) -> bool:
        """An auto request that asks for logprobs the GPU engine cannot hand on with an offloaded decode."""
        wants = request.logprobs is not None or request.prompt_logprobs is not None
        return wants and not all(self.capabilities[w.spec.backend].handed_on_logprobs for w in self.gpu)

    def submit(self, request: GenerateRequest, route: str = "", fields: dict | None = None) -> RequestStream:
        """A stream of the request's events; raises Overloaded, EngineUnavailable or RouteUnavailable. `route`
        is a mode for this request alone (the client's syshax.mode; "auto" lets the decider choose); "": the
        daemon's mode."""
        mode = route or self.mode
        self.servable(mode)
        if self.in_flight() >= self.capacity():
            self.refused["overloaded"] += 1
            raise Overloaded(
                f"the server is at capacity ({self.in_flight()} requests in flight, "
                f"queue of {self.config.max_queue_size} full); retry later"
            )
        decision = None
        if mode == Mode.AUTO and not any(w.state == HandleState.READY for w in self.gpu):
            # the GPU engine is loading or being restarted: the CPU workers serve meanwhile
            decision = self._count(Decision(Route.CPU, f"the GPU engine is not ready ({self._states(self.gpu)}); "
                                            "serving on the CPU", by="gpu_not_ready"))
        elif mode == Mode.AUTO and self._runs_on_cpu_for_logprobs(request):
            # a decode offloaded from the GPU engine would lose them: such a request is not the decider's to place
            decision = self._count(Decision(Route.CPU, "asks for logprobs: runs whole on a CPU worker, as an "
                                            "offloaded decode would not carry them", by="logprobs"))
        elif mode == Mode.AUTO:
            decision = self.decide(fields, request)
            if decision.route is None:
                # both sides are full: wait in the GPU engine's queue, which admission bounded above
                self.queued_for_gpu += 1
                decision = replace(decision, route=Route.GPU, reason=f"{decision.reason}; queued for the GPU engine")
        target = decision.route if decision is not None and decision.route is not None else Route(mode)
        stream = self._dispatch(target, request, decision)
        self.routes[target] += 1
        return stream

    def _dispatch(self, route: Route, request: GenerateRequest, decision: Decision | None) -> RequestStream:
        reason = decision.reason if decision is not None else ""
        by = decision.by if decision is not None else ""
        if route != Route.HETERO:
            return Journey(request, route, self.calls, self.ledger, reason=reason, decided_by=by)
        # a pool: the ready engine holding the request's prefix (engines with their own caches), else the least loaded
        ready = [w for w in self.prefill or self.gpu if w.state == HandleState.READY]
        prefill = (self._by_prefix(ready, request) or min(ready, key=lambda w: w.in_flight)) if ready else None
        if prefill is None:
            # every prefill engine is restarting (or dropped): decode it on the CPU meanwhile, and say so
            self.ledger.tell(WentWithout(Fallback.PREFILL_UNAVAILABLE))
        return Journey(request, route, self.calls, self.ledger, prefill=prefill, reason=reason,
                       token_limit=decision.token_limit if decision is not None else 0, decided_by=by)

    # --- auto: sysHAX's offload decider over live engine state ----------------------------------

    def thresholds(self) -> Thresholds:
        c = self.config
        return Thresholds(max_num_seqs=self.slots(Pool.GPU) or c.max_num_seqs,
                          gpu_cache_threshold=c.gpu_cache_threshold,
                          cpu_throughput_threshold=c.cpu_throughput_threshold,
                          cpu_max_batch_size=self.slots(Pool.CPU),
                          token_limit_multiplier=c.token_limit_multiplier, token_limit_min=c.token_limit_min,
                          token_limit_max=c.token_limit_max)

    def engine_state(self, pool: Pool) -> EngineState:
        """A pool's load. Running and waiting come from the daemon's own count of what each worker holds
        (exact the moment a request is sent, where a worker's report is up to one step old), waiting also
        from the workers' reports (an engine may queue below its batch size: vLLM preempts sequences when
        its KV cache runs out); KV usage and recent tokens/s from the reports."""
        workers = [w for w in self.pools[pool] if w.state == HandleState.READY]
        held = sum(w.generating for w in workers)  # an offloaded prompt on the GPU engine takes no slot there
        slots = sum(w.spec.max_batch_size for w in workers)
        reported_waiting = sum(w.stats.waiting for w in workers)
        # a pool has KV room while one of its engines has (the least loaded takes the next request)
        return EngineState(running=min(held, slots), waiting=max(held - slots, reported_waiting, 0),
                           kv_usage=min((w.stats.kv_usage for w in workers), default=0.0),
                           tokens_per_second=sum(w.stats.tokens_per_second for w in workers))

    def decide(self, fields: dict | None = None, request: GenerateRequest | None = None) -> Decision:
        """Where an auto request goes now -- "gpu", "hetero", or "refuse" when both sides are full -- remembered
        with its inputs for the status. sysHAX's order: an offloaded decode's continuation (no fields: its token
        limit) > the routing rules by priority, when the device they name has room > the decider (measured, or
        0.2.0's thresholds)."""
        gpu, cpu, t = self.engine_state(Pool.GPU), self.engine_state(Pool.CPU), self.thresholds()
        note = ""
        if fields is not None and self.config.routing_rules:
            if request is not None and request.prompt_tokens is not None:
                fields = fields | {"prompt_tokens": len(request.prompt_tokens)}
            rule = next((r for r in self.config.routing_rules if r.matches(fields)), None)
            if rule is not None:
                self.rules_matched[rule.name] += 1
                decision = self._by_rule(rule, gpu, cpu, t)
                if decision is not None:
                    return self._count(decision, gpu, cpu)
                self.rules_without_room[rule.name] += 1
                note = f"rule {rule.name!r} asks for the {rule.device.upper()} side, which has no room; "
        if self.config.decider == "measured":
            decision = decide_measured(gpu, cpu, t, self.estimates.side("gpu", Route.GPU),
                                       self.estimates.side("cpu", Route.HETERO),
                                       Targets(self.config.tpot_target_ms, self.config.ttft_target_ms))
        else:
            decision = decide(gpu, cpu, t)
        return self._count(replace(decision, reason=note + decision.reason) if note else decision, gpu, cpu)

    @staticmethod
    def _by_rule(rule: RoutingRule, gpu: EngineState, cpu: EngineState, t: Thresholds) -> Decision | None:
        """The rule's route when its device has room (the GPU engine by the thresholds, the CPU side a free batch
        slot); None: it has none, and the decider decides. A decode a rule put on the CPU stays there."""
        why = f"rule {rule.name!r}: " + " and ".join(c.words() for c in rule.conditions)
        if rule.route == Route.GPU and decide(gpu, cpu, t).route == Route.GPU:
            return Decision(Route.GPU, why, by=f"rule:{rule.name}")
        if rule.route == Route.HETERO and cpu.running < t.cpu_max_batch_size:
            return Decision(Route.HETERO, why, by=f"rule:{rule.name}")
        return None

    def _count(self, decision: Decision, gpu: EngineState | None = None, cpu: EngineState | None = None) -> Decision:
        self.decisions[decision.verdict] += 1
        self.decided_by[decision.by] += 1
        if gpu is not None and cpu is not None:
            self.last_decision = AutoDecision(time.time(), gpu, cpu, decision.verdict, decision.reason,
                                              decision.token_limit, decision.by)
        log.debug("auto: %s by %s (%s)", decision.verdict, decision.by, decision.reason)
        return decision

    @staticmethod
    def _states(workers) -> str:
        return ", ".join(f"{w.name} {w.state}" + (f" ({w.error})" if w.error else "") for w in workers) or "none"

    # --- status ---------------------------------------------------------------------------------

    def auto_status(self) -> AutoStatus | None:
        """The decider's counts and its last inputs and decision (what `syshax status` explains)."""
        if self._unservable[Mode.AUTO]:
            return None
        return AutoStatus(decisions=dict(self.decisions), queued_for_gpu=self.queued_for_gpu,
                          reconsidered=self.journeys.reconsidered, moved_to_gpu=self.journeys.moved_to_gpu,
                          move_failed=self.journeys.move_failed, last=self.last_decision,
                          thresholds=asdict(self.thresholds()), decider=self.config.decider,
                          decided_by=dict(self.decided_by), rules=[r.name for r in self.config.routing_rules],
                          rules_matched=dict(self.rules_matched), rules_without_room=dict(self.rules_without_room),
                          estimates=self.estimates.to_json())

    def served_type(self) -> str:
        """The weight type the engines load: the GGUF's own, or what it was quantized to ("" if unknown)."""
        f = self.model_file
        return (f.get("quantized_to") or f.get("file_type") or "").upper()

    def status(self) -> SchedulerStatus:
        return SchedulerStatus(
            mode=self.mode,
            modes={m: why or "available" for m, why in self._unservable.items()},
            ready=self.is_ready(),
            in_flight=self.in_flight(),
            queued=self.queued(),
            capacity=self.capacity(),
            max_queue_size=self.config.max_queue_size,
            routes=dict(self.routes),
            refused=dict(self.refused),
            rescued={"resent": self.journeys.resent, "resumed": self.journeys.resumed, "lost": self.journeys.lost},
            auto=self.auto_status(),
            kv=self.ledger.status(),
            prefix_cache=self.ledger.prefix_status(),
            workers=[w.status() for w in self.workers],
            nodes=[link for w in self.workers if (link := w.link_status()) is not None],
            exact=exactness(self.workers, hetero=not self._unservable[Mode.HETERO],
                            file_type=self.served_type()),
            prefix_routing=self.prefix_routing.to_json(),
            model_file=self.model_file,
            embedding_models=[m.status() for m in self.entries.of_kind("embedding")],
            chat_models=[m.status() for m in self.entries.of_kind("chat")],
            pools={str(pool): {"serving": [w.name for w in workers if w.state == HandleState.READY],
                               "out": [f"{w.name} ({w.state})" for w in workers if w.state != HandleState.READY]}
                   for pool, workers in self.pools.items() if workers},
        )
