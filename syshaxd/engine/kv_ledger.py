"""The one owner of the KV records in the ring: which exist, who holds each, and when each is freed.

A record is written by a producer (a prefill worker, or auto mode's GPU engine) and reported to the
daemon in a Prefilled event; from then on this ledger alone frees its ring space. A record is freed
once nobody holds it and nobody reads it:

* holders are references: the request the record was written for holds one until it no longer
  needs it (its decoder reported, it was cancelled, or it was re-routed); anything that keeps
  records beyond their request (a prompt cache) holds its own with ``hold`` / ``unhold``;
* a reader is the decode worker a request lent the record to: it may read the ring at any time
  until it reports Imported (used, refused, or never read because the request was cancelled) or
  dies. Space is never freed under a reader.

Workers report to the ledger through their handles (supervisor.py), request streams through
``lend`` and ``drop``; neither frees ring space itself. Records a producer committed but never
reported (it died in between) are swept ``ORPHAN_GRACE`` seconds after its death.

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

    # --- what producers and decoders report (through their worker handles) --------------------

    def written(self, request_id: str, handle: KVHandle, producer_pid: int) -> None:
        """A producer reported the record it wrote for request_id; the request holds it."""
        self._records[handle.offset] = _Record(handle, request_id, producer_pid, {request_id},
                                               reported_at=time.monotonic())
        self._by_request[request_id] = handle.offset
        self._written += 1
        self._bytes += handle.length

    def imported(self, event: Imported) -> None:
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

    def worker_gone(self, worker: str, pid: int) -> None:
        """A worker died: what it was reading is read no more; what it wrote and never reported is swept soon."""
        for record in list(self._records.values()):
            if record.reader == worker:
                record.reader = ""
                self._free_if_unused(record)
        if self.ring is not None:
            asyncio.get_running_loop().call_later(self.orphan_grace, self.release_orphans, pid)

    # --- what request streams do with a record ------------------------------------------------

    def lend(self, request_id: str, worker: str) -> None:
        """The request's record goes to `worker` for import; it is read until the worker reports."""
        record = self._record_of(request_id)
        if record is not None:
            record.reader = worker

    def drop(self, request_id: str) -> None:
        """The request needs its record no more (cancelled, re-routed, its decoder died)."""
        record = self._record_of(request_id)
        if record is None:
            self._by_request.pop(request_id, None)
            return
        record.holders.discard(request_id)
        self._free_if_unused(record)  # a reader still reports (or dies) before the space goes

    def sent(self, request_id: str) -> None:
        """The request's record was copied to a decode node on another host, or will not be: the node's copy is
        that node's ledger's, and this one is freed (remote/front.py calls this once its write is over)."""
        record = self._record_of(request_id)
        if record is None:
            return
        record.reader = ""
        record.holders.discard(request_id)
        self._free_if_unused(record)

    def fallback(self, reason: Fallback) -> None:
        """A request went to a decoder without any record (e.g. the prefill engine was restarting)."""
        self._fallbacks[str(reason)] += 1

    # --- references beyond a request ----------------------------------------------------------

    def hold(self, offset: int, holder: str) -> None:
        """Keep the record at offset for `holder` (besides its request); KeyError if it is gone."""
        self._records[offset].holders.add(holder)

    def unhold(self, offset: int, holder: str) -> None:
        record = self._records.get(offset)
        if record is not None:
            record.holders.discard(holder)
            self._free_if_unused(record)

    def held(self) -> int:
        return len(self._records)

    # --- the prefix cache ----------------------------------------------------------------------

    def plan_prefix(self, request_id: str, tokens, generate: int = 0) -> PrefixPlan | None:
        """The prompt's cached blocks and slots for its new ones (and for blocks of up to `generate` tokens it
        generates), held for request_id; None without a cache."""
        return self.prefix.plan(request_id, tokens, generate) if self.prefix is not None else None

    def prefix_cached(self, event: Cached) -> None:
        if self.prefix is not None:
            self.prefix.cached(event)

    def prefix_release(self, request_id: str) -> None:
        """The request's stream ended on a worker: whatever of the prefix cache its plan held is let go."""
        if self.prefix is not None:
            self.prefix.release(request_id)

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

    def engine_ready(self, name: str, info: dict) -> None:
        """An engine is ready: the disk tier opens for the kernels it names (in a thread; it scans its folder)."""
        disk = self.prefix.disk if self.prefix is not None else None
        if disk is not None and info.get("prefix_cache"):
            asyncio.get_running_loop().run_in_executor(None, disk.open_for, info | {"name": name})

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
