"""The one owner of the KV records in the ring: which exist, who holds each, and when each is freed.

A record is written by a producer (a prefill worker, or auto mode's GPU engine) and reported to the
daemon in a Prefilled event; from then on this ledger alone frees its ring space. A record is freed
once nobody holds it and nobody reads it:

* holders are references: the request the record was written for holds one until it no longer
  needs it (its decoder reported, it was cancelled, or it was re-routed);
* a reader is the decode worker a request lent the record to: it may read the ring at any time
  until it reports Imported (used, refused, or never read because the request was cancelled) or
  dies. Space is never freed under a reader.

The ledger is told what happens through one door, ``tell``, and a small set of events (LedgerEvent):
what workers report through their handles (supervisor.py: Written, Imported, Cached, WorkerGone,
EngineReady, PlanReleased; remote/front.py: Imported, and SentAway once a record was copied to a node),
what request streams do with a record (journey.py, remote/node.py: Lent, Dropped, Written) and what the
scheduler decides (WentWithout). Every change of a record follows from one of them, here; nobody else frees
ring space. Records a producer committed but never reported (it died in between) are swept
``ORPHAN_GRACE`` seconds after its death. (`syshax cache clear` empties the prefix cache's index itself,
through the admin socket: blocks, not records.)

The ledger also owns the prefix cache's index (engine/prefix_cache.py): which prompt blocks the
block store keeps, which request holds which, which are evicted. Workers report what they wrote
there (Cached) through their handles, as they report records.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from syshaxd.engine.prefix_cache import PrefixCache, PrefixStatus
from syshaxd.sdk.types import Cached, Fallback, Imported, KVHandle, PrefixPlan

log = logging.getLogger(__name__)

ORPHAN_GRACE = 2.0  # seconds after a KV producer died before its unreported records are freed
LATENCY_WINDOW = 1000  # handoffs kept for the latency quantiles


# --- what the ledger is told ----------------------------------------------------------------------
# Besides these, it takes two of the workers' own messages as they come: Imported (a decoder is done with a
# request's record) and Cached (blocks a worker wrote into the prefix cache's store).

@dataclass(frozen=True)
class Written:
    """A producer reported the record it wrote for request_id: the request holds it."""

    request_id: str
    handle: KVHandle
    producer_pid: int


@dataclass(frozen=True)
class Lent:
    """The request's record goes to `worker` for import: it is read until the worker reports or dies."""

    request_id: str
    worker: str


@dataclass(frozen=True)
class Dropped:
    """The request needs its record no more (cancelled, re-routed, its decoder died)."""

    request_id: str


@dataclass(frozen=True)
class SentAway:
    """The request's record was copied to a decode node on another host, or will not be: the node's copy is that
    node's ledger's, and this one is let go (remote/front.py, once its write is over)."""

    request_id: str


@dataclass(frozen=True)
class WentWithout:
    """A request went to a decoder without any record (e.g. the prefill engine was restarting): counted."""

    reason: Fallback


@dataclass(frozen=True)
class WorkerGone:
    """A worker died: what it was reading is read no more; what it wrote and never reported is swept soon."""

    worker: str
    pid: int


@dataclass(frozen=True)
class PlanReleased:
    """The request's stream ended on a worker: whatever of the prefix cache its plan held is let go."""

    request_id: str


@dataclass(frozen=True)
class EngineReady:
    """An engine is ready: the prefix cache's disk tier opens for the kernels it names."""

    name: str
    info: dict


LedgerEvent = (Written | Imported | Cached | Lent | Dropped | SentAway | WentWithout | WorkerGone | PlanReleased
               | EngineReady)


@dataclass(frozen=True)
class Quantiles:
    count: int = 0
    p50: float = 0.0
    p90: float = 0.0
    p99: float = 0.0

    @classmethod
    def of(cls, values) -> "Quantiles":
        ordered = sorted(values)
        if not ordered:
            return cls()
        pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
        return cls(len(ordered), pick(0.5), pick(0.9), pick(0.99))


@dataclass(frozen=True)
class RingStatus:
    capacity: int
    used_bytes: int
    occupancy: float
    records_written: int
    records_released: int
    records_skipped: int
    generation: int


@dataclass(frozen=True)
class KVStatus:
    """The handoff's counts, for /v1/syshax/status, `syshax status` and /metrics."""

    ring: RingStatus
    records_written: int  # records producers reported
    records_read: int  # records a decoder imported
    records_failed: int  # records a decoder could not use (a bad record, not a missing one)
    orphans_released: int  # records a dead producer committed and never reported
    records_held: int  # records in the ring now, held or being read
    bytes_moved: int
    fallbacks: dict[str, int]  # Fallback -> requests whose decoder recomputed the prompt
    handoff_latency_s: Quantiles  # record reported -> imported


@dataclass(eq=False)
class _Record:
    handle: KVHandle
    request_id: str  # the request it was written for
    producer_pid: int
    holders: set[str] = field(default_factory=set)
    reader: str = ""  # the worker reading it, until it reports or dies
    reported_at: float = 0.0  # monotonic


class KVLedger:
    """Every KV record the daemon knows of, by ring offset; works without a ring too (cpu and gpu modes)."""

    def __init__(self, ring=None, orphan_grace: float = ORPHAN_GRACE, prefix: PrefixCache | None = None) -> None:
        self.ring = ring
        self.prefix = prefix  # the prefix cache's index; None: no prefix cache
        self.orphan_grace = orphan_grace
        self._records: dict[int, _Record] = {}  # ring offset -> record
        self._by_request: dict[str, int] = {}  # request id -> the offset of the record written for it
        self._written = self._read = self._failed = self._orphans = self._bytes = 0
        self._fallbacks: Counter = Counter()
        self._latency: deque = deque(maxlen=LATENCY_WINDOW)
        self._reading: dict[int, asyncio.Future] = {}  # prefix cache block key -> the read bringing it back from disk

    # --- the one door ----------------------------------------------------------------------------

    def tell(self, event: LedgerEvent) -> None:
        """What happened to a record, a prefix plan or an engine; the ledger alone decides what follows."""
        match event:
            case Written():
                self._record_written(event)
            case Imported():
                self._imported(event)
            case Cached():
                if self.prefix is not None:
                    self.prefix.cached(event)
            case Lent():
                record = self._record_of(event.request_id)
                if record is not None:
                    record.reader = event.worker
            case Dropped():
                self._dropped(event.request_id)
            case SentAway():
                self._let_go(event.request_id)
            case WentWithout():
                self._fallbacks[str(event.reason)] += 1
            case WorkerGone():
                self._worker_gone(event)
            case PlanReleased():
                if self.prefix is not None:
                    self.prefix.release(event.request_id)
            case EngineReady():
                self._engine_ready(event)
            case _:
                raise TypeError(f"the KV ledger is not told {type(event).__name__}")

    def held(self) -> int:
        """Records the ledger keeps."""
        return len(self._records)

    # --- what each event does --------------------------------------------------------------------

    def _record_written(self, event: Written) -> None:
        handle = event.handle
        self._records[handle.offset] = _Record(handle, event.request_id, event.producer_pid, {event.request_id},
                                               reported_at=time.monotonic())
        self._by_request[event.request_id] = handle.offset
        self._written += 1
        self._bytes += handle.length

    def _imported(self, event: Imported) -> None:
        """A decoder is done with the request's record (used, refused, or never read): count it, free it."""
        if event.ok:
            self._read += 1
        elif event.reason != Fallback.CANCELLED:
            self._fallbacks[str(event.reason)] += 1
            if event.reason in _BAD_RECORD:
                self._failed += 1
        offset = self._by_request.pop(event.request_id, None)
        record = self._records.get(offset) if offset is not None else None
        if record is None:
            return
        if event.ok:
            self._latency.append(time.monotonic() - record.reported_at)
        record.reader = ""
        record.holders.discard(event.request_id)
        self._free_if_unused(record)

    def _worker_gone(self, event: WorkerGone) -> None:
        for record in list(self._records.values()):
            if record.reader == event.worker:
                record.reader = ""
                self._free_if_unused(record)
        if self.ring is not None:
            asyncio.get_running_loop().call_later(self.orphan_grace, self.release_orphans, event.pid)

    def _dropped(self, request_id: str) -> None:
        record = self._record_of(request_id)
        if record is None:
            self._by_request.pop(request_id, None)
            return
        record.holders.discard(request_id)
        self._free_if_unused(record)  # a reader still reports (or dies) before the space goes

    def _let_go(self, request_id: str) -> None:
        record = self._record_of(request_id)
        if record is None:
            return
        record.reader = ""
        record.holders.discard(request_id)
        self._free_if_unused(record)

    def _engine_ready(self, event: EngineReady) -> None:
        disk = self.prefix.disk if self.prefix is not None else None
        if disk is not None and event.info.get("prefix_cache"):
            asyncio.get_running_loop().run_in_executor(None, disk.open_for, event.info | {"name": event.name})

    # --- what the scheduler asks of the prefix cache (a plan holds its blocks until PlanReleased) ---

    def plan_prefix(self, request_id: str, tokens, generate: int = 0) -> PrefixPlan | None:
        """The prompt's cached blocks and slots for its new ones (and for blocks of up to `generate` tokens it
        generates), held for request_id; None without a cache."""
        return self.prefix.plan(request_id, tokens, generate) if self.prefix is not None else None

    async def prefix_from_disk(self, tokens) -> None:
        """Read back from the disk tier the blocks the prompt starts with that only the disk still holds, before
        the prompt is planned (in a thread: the event loop and the engines' steps go on meanwhile)."""
        prefix = self.prefix
        if prefix is None or prefix.disk is None:
            return
        wanted = prefix.from_disk(tokens)
        reads = {self._reading[key] for key in wanted.waits if key in self._reading}  # another prompt's, shared
        if wanted.taken:
            disk, taken = prefix.disk, wanted.taken

            def read() -> list:
                return [(key, slot, disk.read_into(key, slot)) for key, slot in taken]

            def done(task: asyncio.Future) -> None:  # runs even if the request was cancelled: the slots come back
                failed = task.cancelled() or task.exception() is not None
                if failed and not task.cancelled():
                    log.error("prefix cache on disk: reading blocks back failed: %s", task.exception())
                for key, _ in taken:
                    self._reading.pop(key, None)
                prefix.loaded([(key, slot, None) for key, slot in taken] if failed else task.result())

            task = asyncio.ensure_future(asyncio.to_thread(read))
            task.add_done_callback(done)
            for key, _ in taken:
                self._reading[key] = task
            reads.add(task)
        if reads:
            await asyncio.shield(asyncio.gather(*reads, return_exceptions=True))

    def prefix_status(self) -> PrefixStatus | None:
        return self.prefix.status() if self.prefix is not None else None

    # --- freeing ---------------------------------------------------------------------------------

    def _record_of(self, request_id: str) -> _Record | None:
        offset = self._by_request.get(request_id)
        return self._records.get(offset) if offset is not None else None

    def _free_if_unused(self, record: _Record) -> None:
        if record.holders or record.reader:
            return
        offset = record.handle.offset
        if self._records.get(offset) is record:
            del self._records[offset]
            if self._by_request.get(record.request_id) == offset:
                del self._by_request[record.request_id]
            self._free(offset)

    def _free(self, offset: int) -> None:
        if self.ring is None:
            return
        from syshaxd.sdk.kv.ring import RingError

        try:
            self.ring.release(offset)
        except RingError as exc:  # the ring was reset meanwhile
            log.debug("record at %d already gone: %s", offset, exc)

    def release_orphans(self, pid: int) -> int:
        """Free the committed records of writer `pid` that the ledger does not know; how many.

        A producer may die after committing a record and before reporting it: nobody would free that
        one, and the ring's tail would stick behind it. The grace lets the reports it did send arrive
        first; a record freed under a request anyway only makes its decoder recompute.
        """
        if self.ring is None:
            return 0
        freed = 0
        for info in list(self.ring.records()):
            if info.state == "committed" and info.writer_pid == pid and info.offset not in self._records:
                self._free(info.offset)
                freed += 1
        if freed:
            self._orphans += freed
            log.warning("freed %d KV record(s) that KV producer pid %d committed but never handed on", freed, pid)
        return freed

    # --- status ----------------------------------------------------------------------------------

    def status(self) -> KVStatus | None:
        if self.ring is None:
            return None
        r = self.ring.stats()
        ring = RingStatus(self.ring.capacity, r.used_bytes, r.occupancy, r.records_written, r.records_released,
                          r.records_skipped, r.generation)
        return KVStatus(ring, self._written, self._read, self._failed, self._orphans, len(self._records),
                        self._bytes, dict(self._fallbacks), Quantiles.of(self._latency))


# fallbacks that mean a record was there and could not be used (the others: it never came)
_BAD_RECORD = frozenset({Fallback.CHECKSUM, Fallback.FINGERPRINT, Fallback.STALE, Fallback.TOKEN_MISMATCH,
                         Fallback.STATE_FORMAT, Fallback.NO_RING})
