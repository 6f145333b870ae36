"""Daemon side of one engine worker: spawns it, routes its events, notices death or a hang, restarts it."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import multiprocessing.process
import signal
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from dataclasses import replace

import psutil

from syshaxd.engine.attempts import new_attempt, request_of
from syshaxd.engine.channel import ChannelClosed, ChannelFull, WorkerChannel
from syshaxd.engine.engine_handle import EngineUnavailable, WorkerStream
from syshaxd.engine.kv_ledger import Dropped, EngineReady, KVLedger, PlanReleased, WorkerGone, Written
from syshaxd.engine.lifecycle import WORKER_MOVES, HandleState, Lifecycle, LifecycleState
from syshaxd.engine.status import WorkerStatus
from syshaxd.sdk.types import (
    Cached,
    Cancel,
    Delta,
    Embed,
    Embedded,
    EmbedRequest,
    EngineSpec,
    EngineStats,
    GenerateRequest,
    Handling,
    Imported,
    Prefilled,
    Rejected,
    Shutdown,
    Submit,
    WorkerFailed,
    WorkerLost,
    WorkerReady,
    WorkerStats,
    WorkerWarming,
)
from syshaxd.sdk.worker import worker_main

log = logging.getLogger(__name__)


class WorkerHandle:
    """One engine worker process.

    A ready worker sends its stats every STATS_INTERVAL when idle and its output after every engine
    step when busy. One silent for longer than heartbeat_timeout is hung when it is stopped (SIGSTOP)
    or makes no progress (no CPU time since the last look: deadlocked, blocked); one still burning CPU
    is in a long engine step and is spared up to BUSY_GRACE times the timeout. A hung worker is killed
    and its death handled like any other: in-flight requests end with a clean error (or go elsewhere
    when no token was sent yet), and a new worker starts.
    """

    BUSY_GRACE = 4
    remote = False  # a process of this host (remote/front.py's RemoteNode is a decode node on another)
    CRASH_LOOP = 3  # deaths in a row without a token served (or a prompt handed on): a crash loop
    state = LifecycleState()  # changed only along WORKER_MOVES (engine/lifecycle.py)

    def __init__(self, name: str, spec: EngineSpec, log_level: str, restart_delay: float,
                 heartbeat_timeout: float = 30.0, ledger: KVLedger | None = None,
                 on_failed: Callable[["WorkerHandle"], None] | None = None) -> None:
        self.name = name
        self.spec = spec
        self.log_level = log_level
        self.restart_delay = restart_delay
        self.heartbeat_timeout = heartbeat_timeout  # 0: never declared hung
        self.hangs = 0  # workers killed for silence
        self.lifecycle = Lifecycle(name, WORKER_MOVES)
        self.info: dict = {}
        self.stats = EngineStats()
        self.error = ""
        self.restarts = 0
        self.last_heartbeat = 0.0
        self.streams: dict[str, WorkerStream] = {}  # by attempt id: what the worker is running for us
        self.barren_deaths = 0  # deaths since it last served a token: CRASH_LOOP of them is a crash loop
        self.safer_kernels: dict = {}  # what its engine said gives safer kernels (WorkerWarming), tried once
        self.safer_kernels_lose = ""
        self.on_safer_kernels = ""  # why it runs safer kernels, for the status; "" while it runs as configured
        self._warmup_error = ""  # what the worker said when its warm-up raised
        self._on_failed = on_failed  # told once the worker is given up on (the daemon's status line)
        self.ledger = ledger or KVLedger()  # the owner of the KV records this worker writes or reads
        self.ready = asyncio.Event()
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self._channel: WorkerChannel | None = None
        self._stopping = False
        self._restart_task: asyncio.Task | None = None
        self._watch: asyncio.TimerHandle | None = None
        self._hung_for = 0.0  # set when this worker was killed for silence: its requests' errors say so
        self._cpu_seen: float | None = None  # the silent worker's CPU seconds at the previous look
        self._loop = asyncio.get_running_loop()

    # --- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        process = ctx.Process(
            target=worker_main, args=(child, self.spec, self.name, self.log_level), name=self.name, daemon=True
        )
        self._process = process
        self.state = HandleState.STARTING
        self.ready.clear()
        process.start()
        child.close()
        self._conn = parent  # owns the fd; the channel reads and writes it
        self._channel = WorkerChannel(parent.fileno(), self._loop, self._dispatch, self._on_channel_broken)
        self._loop.add_reader(process.sentinel, self._on_exit)
        self._hung_for = 0.0
        self._cpu_seen = None
        self._schedule_watch()
        log.info("%s: started worker pid %d (%s, %s)", self.name, process.pid, self.spec.backend, self.spec.role)

    async def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        if self._restart_task:
            self._restart_task.cancel()
        proc = self._process
        if proc is None:
            return
        if self._channel is not None:
            try:
                self._channel.send(Shutdown(), bounded=False)
            except (ChannelClosed, ChannelFull):
                pass
        deadline = time.monotonic() + timeout
        while proc.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if proc.is_alive():
            log.warning("%s: worker did not stop in %.0fs; killing it", self.name, timeout)
            proc.kill()
            proc.join(2)
        self._detach()
        self.state = HandleState.STOPPED

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def _detach(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        if self._channel is not None:
            self._channel.detach()
            self._channel = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._process is not None:
            self._loop.remove_reader(self._process.sentinel)
            self._process = None

    # --- hang detection ---------------------------------------------------------------------

    def _schedule_watch(self) -> None:
        if self.heartbeat_timeout > 0:
            self._watch = self._loop.call_later(min(1.0, self.heartbeat_timeout / 4), self._check_heartbeat)

    def _check_heartbeat(self) -> None:
        self._watch = None
        proc = self._process
        if proc is None or self._stopping:
            return
        if self.state == HandleState.READY and self._channel is not None:
            self._channel.drain()  # our own loop may have been the slow one: read what is there first
            silent = time.monotonic() - self.last_heartbeat
            if silent <= self.heartbeat_timeout:
                self._cpu_seen = None
            elif self._process is proc and proc.pid is not None and self._hung(proc.pid, silent):
                self.hangs += 1
                self._hung_for = silent
                log.error("%s: worker pid %d sent nothing for %.1fs (worker_heartbeat_timeout %gs): it is hung; "
                          "killing it and starting a new one", self.name, proc.pid, silent, self.heartbeat_timeout)
                proc.kill()  # SIGKILL works on a stopped process too; _on_exit does the rest
                return
        self._schedule_watch()

    def _hung(self, pid: int, silent: float) -> bool:
        """Whether a worker silent past the timeout is hung, not busy in one long engine step."""
        try:
            proc = psutil.Process(pid)
            if proc.status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
                return True
            times = proc.cpu_times()
            cpu = times.user + times.system
        except psutil.Error:
            return False  # already gone: _on_exit takes over
        before, self._cpu_seen = self._cpu_seen, cpu
        if silent > self.BUSY_GRACE * self.heartbeat_timeout:
            return True  # a step that long is a livelock, not work
        return before is not None and cpu <= before

    # --- events from the worker -----------------------------------------------------------

    def _on_channel_broken(self, why: str) -> None:
        """The pipe broke: the worker cannot be reached any more, so it is replaced now, not after a heartbeat.

        Its exit (the sentinel) does the rest, as for any death: requests with no token yet are told to
        retry (a hetero request goes to another decoder by itself), the others end with an error.
        """
        proc = self._process
        if proc is None or self._stopping or not proc.is_alive():
            return  # it is gone already: its exit does the rest
        log.error("%s: the pipe to worker pid %d broke (%s); replacing the worker", self.name, proc.pid, why)
        proc.kill()

    def _dispatch(self, msg) -> None:
        self.last_heartbeat = time.monotonic()
        if isinstance(msg, list):
            for event in msg:
                if self.barren_deaths and (isinstance(event, (Prefilled, Embedded))
                                           or (isinstance(event, Delta) and event.n_tokens)):
                    self.barren_deaths = 0  # it serves: whatever killed it before is not every request
                attempt = event.request_id
                stream = self.streams.get(attempt)
                # the request's own id from here on: the ledger, the journey and the API know it by that
                event = replace(event, request_id=stream.request_id if stream is not None else request_of(attempt))
                self._report_kv(event, attempt, stream is None)
                if stream is None or isinstance(event, Cached):
                    continue  # an attempt cancelled on our side (its last events still come), or the ledger's alone
                if isinstance(event, (Rejected, Prefilled, Embedded)) or (isinstance(event, Delta)
                                                                          and event.finish_reason):
                    del self.streams[attempt]
                    self.ledger.tell(PlanReleased(event.request_id))
                stream.queue.put_nowait(event)
        elif isinstance(msg, WorkerStats):
            self.stats = msg.stats
        elif isinstance(msg, WorkerWarming):
            self.info = msg.info
            self.safer_kernels, self.safer_kernels_lose = dict(msg.safer_kernels), msg.safer_kernels_lose
            self.state = HandleState.WARMING
            log.info("%s: engine built; warming up (kernels: %s, %s)", self.name, msg.info.get("kernels", "?"),
                     msg.info.get("kernels_why", ""))
        elif isinstance(msg, WorkerFailed) and msg.during == "warm-up" and msg.kernels_suspect and self.safer_kernels:
            self._warmup_error = msg.message  # it exits now; _on_exit restarts it with safer kernels
        elif isinstance(msg, WorkerReady):
            self.info = msg.info
            if msg.proofs is not None:  # its restarts run on this CPU and build too: they need not prove it again
                self.spec = replace(self.spec, proven=msg.proofs)
            self.state = HandleState.READY
            self.error = ""
            self.ready.set()
            self.ledger.tell(EngineReady(self.name, self.info))
            log.info("%s: ready (%s, n_ctx=%s, batch=%s, cpus=%s)", self.name, self.info.get("model_name"),
                     self.info.get("n_ctx"), self.info.get("max_batch_size"), self.info.get("cpus"))
        elif isinstance(msg, WorkerFailed):
            self.error = msg.message if msg.during == "build" else f"its warm-up failed: {msg.message}"
            self.state = HandleState.FAILED
            log.error("%s: engine failed to start: %s", self.name, self.error)
            if self._on_failed is not None:
                self._on_failed(self)

    def _report_kv(self, event, attempt: str, orphaned: bool) -> None:
        """Tell the ledger of a record written (and, when its attempt was cancelled, no longer wanted) or read."""
        if isinstance(event, Prefilled) and event.handle is not None:
            if orphaned:  # no request holds it: known by its attempt alone, and freed at once
                self.ledger.tell(Written(attempt, event.handle, self.pid or 0))
                self.ledger.tell(Dropped(attempt))
            else:
                self.ledger.tell(Written(event.request_id, event.handle, self.pid or 0))
        elif isinstance(event, Imported):
            self.ledger.tell(event)
        elif isinstance(event, Cached):
            self.ledger.tell(event)

    def _on_exit(self) -> None:
        if self._process is None:
            return
        self._process.join(1)
        code, pid = self._process.exitcode, self._process.pid
        if self._channel is not None:
            self._channel.drain()  # events it sent just before dying still count
        was_failed = self.state == HandleState.FAILED
        warming = self.state == HandleState.WARMING
        self._detach()
        self.ready.clear()
        lost = list(self.streams.values())
        self.streams.clear()
        for stream in lost:
            self.ledger.tell(PlanReleased(stream.request_id))
        verdict = ""  # how this death is answered: "" restart as it was, "safer" (kernels) or "failed"
        if not self._stopping and not was_failed:
            self.barren_deaths += 1
            verdict = self._judge_death(code, warming)
        if self._stopping:
            why = "was stopped"
        elif self._hung_for:
            why = f"stopped responding ({self._hung_for:.0f}s without a heartbeat) and was replaced"
        else:
            why = "died"
        for stream in lost:  # each request's journey goes on elsewhere, or ends saying why
            stream.queue.put_nowait(WorkerLost(stream.request_id, why, failed=verdict == "failed", error=self.error,
                                               stopping=self._stopping))
        if not self._stopping and pid is not None:  # it ran (a process never started has no pid)
            self.ledger.tell(WorkerGone(self.name, pid))
        if self._stopping or was_failed or verdict == "failed":
            return  # the engine cannot be built or keeps dying; restarting would fail the same way
        self.state = HandleState.RESTARTING
        self.restarts += 1
        if verdict != "safer":
            log.error("%s: worker exited (%s%s) with %d requests in flight; restarting in %.1fs", self.name,
                      _exit_words(code), ", killed as hung" if self._hung_for else "", len(lost), self.restart_delay)
        self._restart_task = self._loop.create_task(self._restart_later())

    def _judge_death(self, code: int | None, warming: bool) -> str:
        """A death in the warm-up or the CRASH_LOOP-th in a row without a token served says the engine cannot
        run as it is: restart it with its safer kernels once, else give it up ("failed")."""
        how = _exit_words(code)
        kernels = self.info.get("kernels", "")
        if warming:
            cause = (f"failed its warm-up ({self._warmup_error})" if self._warmup_error
                     else f"died ({how}) in its warm-up, running its {kernels} kernels on a prompt chunk and a decode batch")
        elif self.barren_deaths >= self.CRASH_LOOP:
            cause = (f"died {self.barren_deaths} times in a row without serving a token ({how} the last time): "
                     "a crash loop")
        else:
            return ""
        self._warmup_error = ""
        if code == -signal.SIGILL:
            cause += ("; SIGILL means its native code uses instructions this CPU lacks: it was built on another "
                      "CPU (for llama.cpp, rebuild it here with make install, which runs mk/llama-wheel.sh)")
        if self.safer_kernels:
            changes, loses = self.safer_kernels, self.safer_kernels_lose
            self.spec = replace(self.spec, **changes, proven=None)  # other kernels: their bits are proved anew
            self.safer_kernels, self.barren_deaths = {}, 0
            self.on_safer_kernels = f"{loses} turned off: the engine {cause}"
            settings = ", ".join(f'{k} = "{v}"' for k, v in changes.items())
            log.error("%s: the engine %s. Restarting it with %s turned off (as with %s in the config): it serves "
                      "correctly, prompts run slower. Set that in the config to skip this on later starts.",
                      self.name, cause, loses, settings)
            return "safer"
        self.state = HandleState.FAILED
        self.error = f"the engine {cause}; not restarted (it has no safer kernels to try)"
        log.error("%s: %s", self.name, self.error)
        if self._on_failed is not None:
            self._on_failed(self)
        return "failed"

    async def _restart_later(self) -> None:
        await asyncio.sleep(self.restart_delay)
        if not self._stopping:
            self.start()

    # --- requests -------------------------------------------------------------------------

    def submit(self, request: GenerateRequest, handling: Handling = Handling()) -> WorkerStream:
        return self._sent(request.request_id, lambda attempt: Submit(replace(request, request_id=attempt), handling),
                          handoff=handling.handoff)

    def embed(self, request: EmbedRequest) -> WorkerStream:
        """An embedding worker's request (Role.EMBED): its stream ends with Embedded or Rejected; it holds no batch
        slot."""
        return self._sent(request.request_id, lambda attempt: Embed(replace(request, request_id=attempt)),
                          handoff=True)

    def _sent(self, request_id: str, message: Callable[[str], Submit | Embed], handoff: bool) -> WorkerStream:
        """A new attempt of the request sent whole (or not at all: EngineUnavailable), and its stream."""
        if self.state != HandleState.READY or self._channel is None:
            raise EngineUnavailable(f"{self.name} is {self.state}")
        attempt = new_attempt(request_id)  # what the worker knows this submission by
        try:
            self._channel.send(message(attempt))
        except ChannelFull as exc:
            raise EngineUnavailable(f"{self.name} is not taking requests this fast ({exc}); retry shortly") from None
        except ChannelClosed:
            raise EngineUnavailable(f"{self.name} cannot be reached (being replaced); retry shortly") from None
        stream = WorkerStream(request_id, self, attempt, handoff=handoff)
        self.streams[attempt] = stream
        return stream

    def cancel(self, attempt: str) -> None:
        """Cancel an attempt (WorkerStream.cancel): what the worker still sends of it is dropped on arrival."""
        stream = self.streams.pop(attempt, None)
        if stream is not None:
            self.ledger.tell(PlanReleased(stream.request_id))
        if self._channel is not None:
            try:
                self._channel.send(Cancel(attempt), bounded=False)
            except (ChannelClosed, ChannelFull):
                pass  # a broken pipe replaces the worker, and the sequence goes with it

    @property
    def in_flight(self) -> int:
        return len(self.streams)

    @property
    def generating(self) -> int:
        """Requests it holds that take (or wait for) a batch slot: all but prompts it only hands on."""
        return sum(1 for s in self.streams.values() if not s.handoff)

    def set_log_level(self, level: str) -> None:
        self.log_level = level  # a worker reads it when it starts: the next (re)start takes it

    def link_status(self) -> None:
        return None  # a process of this host has no link

    def status(self) -> WorkerStatus:
        return WorkerStatus(name=self.name, backend=self.spec.backend, role=self.spec.role, pool=self.spec.pool,
                            state=self.state, pid=self.pid, error=self.error, restarts=self.restarts,
                            hangs=self.hangs, in_flight=self.in_flight, cpus=list(self.info.get("cpus", [])),
                            threads=self.spec.threads, stats=self.stats,
                            kernels=str(self.info.get("kernels", "")),
                            kernels_why=self.on_safer_kernels or str(self.info.get("kernels_why", "")),
                            attention=str(self.info.get("attention", "")),
                            exact_decode=bool(self.info.get("exact_decode", False)),
                            keeps_generated=bool(self.info.get("keeps_generated", False)),
                            lone_padding=bool(self.info.get("lone_padding", False)),
                            speculative_tokens=int(self.info.get("speculative_tokens", 0)),
                            draft_model=str(self.info.get("draft_model", "")),
                            state_checkpoints_mb=int(self.info.get("state_checkpoints_mb", 0)))


def _exit_words(code: int | None) -> str:
    """A process's exit status in words: "SIGSEGV (segmentation fault)", "exit code 1"."""
    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            sig = signal.Signals(-code)
        except ValueError:
            return f"signal {-code}"
        return f"{sig.name} ({(signal.strsignal(sig) or sig.name).lower()})"
    return f"exit code {code}"


__all__ = ["WorkerHandle"]
