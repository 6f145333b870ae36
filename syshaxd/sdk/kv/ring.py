"""Shared-memory KV ring: producers hand variable-size KV records to decode workers through /dev/shm.

Usually one producer (the prefill worker); a pool of prefill engines shares the ring, each claiming its records in
turn under the ring's lock. A record's header names its writer, so a dead producer's half-written record is skipped
whoever wrote the records around it.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

MAGIC = b"SYSHAXKR"
VERSION = 1
HEADER_SIZE = 4096  # the data area starts on its own page
RECORD_HEADER = 64  # one cache line, so every payload starts 64-byte aligned
ALIGN = 64
DEFAULT_DIRECTORY = "/dev/shm"
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14+

# Ring header, as u64 words. head and tail are monotonic byte counters (offset = counter % capacity),
# so "used" is always head - tail and never ambiguous between empty and full.
_H_MAGIC, _H_VERSION, _H_CAPACITY, _H_HEAD, _H_TAIL, _H_GENERATION, _H_OWNER, _H_WRITER = range(8)
_H_SEQ, _H_WRITTEN, _H_BYTES, _H_RELEASED, _H_SKIPPED = range(8, 13)

# Record header: u32 state (the commit word), u32 writer pid, u64 payload length, u64 seq, u64 generation.
def _word(tag: bytes) -> int:
    return int.from_bytes(tag, "little")


RESERVED = _word(b"RESV")  # claimed, being filled
COMMITTED = _word(b"COMT")  # written last, after the payload
RELEASED = _word(b"RELS")  # consumer done; the tail may pass it
PAD = _word(b"PADD")  # filler up to the end of the segment before a wrap
ABANDONED = _word(b"DEAD")  # producer died or aborted before committing
_STATE_NAMES = {RESERVED: "reserved", COMMITTED: "committed", RELEASED: "released",
                PAD: "pad", ABANDONED: "abandoned"}


class RingError(Exception):
    """The ring cannot do what was asked (bad offset, wrong state, corrupt header)."""


class RingFull(RingError):
    """No space freed before the deadline: the caller should fall back (recompute the prefill)."""


class StaleRecord(RingError):
    """The offset belongs to a generation of the ring that was reset since."""


@dataclass(frozen=True)
class RingStats:
    capacity: int
    used_bytes: int
    free_bytes: int
    generation: int
    records_written: int
    bytes_written: int
    records_released: int
    records_skipped: int
    records_read: int  # read() calls through this handle
    owner_pid: int
    writer_pid: int

    @property
    def occupancy(self) -> float:
        return self.used_bytes / self.capacity


@dataclass(frozen=True)
class RecordInfo:
    offset: int
    length: int
    seq: int
    writer_pid: int
    state: str


def _align(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a SIGKILLed child stays a zombie until reaped, and kill(pid, 0) still succeeds on it
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    return stat[stat.rindex(b")") + 2:][:1] not in (b"Z", b"X")


def ring_path(instance: str, directory: str | os.PathLike = DEFAULT_DIRECTORY) -> Path:
    if not instance or "/" in instance or instance.startswith("."):
        raise ValueError(f"instance={instance!r}: must be a non-empty name without '/' or a leading '.'")
    return Path(directory) / f"syshax-{instance}-kv"


class Reservation:
    """A claimed region of the ring: fill `view`, then commit()."""

    def __init__(self, ring: KVRing, offset: int, length: int, seq: int, view: memoryview):
        self.offset = offset
        self.length = length
        self.seq = seq
        self.view = view
        self._ring = ring
        self._done = False

    def commit(self) -> int:
        """Publish the record (commit word written last) and return its offset."""
        self._finish(COMMITTED)
        self._ring._count_commit(self.length)
        return self.offset

    def abort(self) -> None:
        """Give the space back without publishing anything."""
        self._finish(ABANDONED)

    def _finish(self, state: int) -> None:
        if self._done:
            raise RingError(f"record at offset {self.offset} was already committed or aborted")
        self._done = True
        self._ring._set_state(self.offset, state)


class KVRing:
    """A handle on one ring segment; create() in the owner (daemon), attach() in producers and consumers."""

    def __init__(self, path: Path, fd: int, *, owner: bool, prefault: bool):
        self.path = path
        self.owner = owner
        self._fd = fd
        self._pid = os.getpid()
        self._mm = mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        if prefault:
            # fault every page in now: otherwise each first lap pays for them, ~14x slower than later laps
            try:
                self._mm.madvise(_MADV_POPULATE_WRITE)
            except OSError:
                pass  # older kernel: the first lap is slower, nothing else
        self._capacity = len(self._mm) - HEADER_SIZE
        self._view = memoryview(self._mm)
        self._q = self._view.cast("Q")
        self._i = self._view.cast("I")
        self._thread_lock = threading.Lock()
        self._reads = 0
        self._wrote = False  # this handle reserved: closing it gives up the writer role
        self._closed = False

    # -- opening and closing ------------------------------------------------------------------

    @classmethod
    def create(cls, instance: str, capacity: int, *, directory: str | os.PathLike = DEFAULT_DIRECTORY,
               prefault: bool = True) -> KVRing:
        if capacity < 4096 or capacity % ALIGN:
            raise ValueError(f"capacity={capacity}: must be at least 4096 and a multiple of {ALIGN} bytes")
        path = ring_path(instance, directory)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except FileExistsError as e:
            raise FileExistsError(e.errno, "KV ring segment exists: a live daemon owns it, "
                                  "or sweep_stale() was not run at start", str(path)) from None
        try:
            os.fchmod(fd, 0o600)  # exact mode whatever the umask
            os.ftruncate(fd, HEADER_SIZE + capacity)
            ring = cls(path, fd, owner=True, prefault=prefault)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        q = ring._q
        q[_H_VERSION] = VERSION
        q[_H_CAPACITY] = capacity
        q[_H_OWNER] = os.getpid()
        q[_H_MAGIC] = _word(MAGIC)  # last: a half-initialised segment never looks valid
        return ring

    @classmethod
    def attach(cls, instance: str, *, directory: str | os.PathLike = DEFAULT_DIRECTORY,
               prefault: bool = True) -> KVRing:
        path = ring_path(instance, directory)
        fd = os.open(path, os.O_RDWR)
        try:
            head = os.pread(fd, 8 * (_H_CAPACITY + 1), 0)
            size = os.fstat(fd).st_size
            if len(head) < 8 * (_H_CAPACITY + 1) or head[:8] != MAGIC:
                raise RingError(f"{path} is not a syshax KV ring")
            version, capacity = struct.unpack_from("<QQ", head, 8 * _H_VERSION)
            if version != VERSION:
                raise RingError(f"{path}: ring version {version}, this code reads version {VERSION}")
            if size != HEADER_SIZE + capacity:
                raise RingError(f"{path}: header says {capacity} bytes of ring, the file holds {size}")
            return cls(path, fd, owner=False, prefault=prefault)
        except BaseException:
            os.close(fd)
            raise

    def close(self) -> None:
        """Unmap and close; views handed out keep the mapping alive until they go."""
        if self._closed:
            return
        self._closed = True
        if self._wrote and self._q[_H_WRITER] == os.getpid():
            self._q[_H_WRITER] = 0  # let the next producer take over at once
        for v in (self._q, self._i, self._view):
            v.release()
        try:
            self._mm.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes with the last one
        os.close(self._fd)

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def __enter__(self) -> KVRing:
        return self

    def __exit__(self, *exc) -> None:
        if self.owner:
            self.unlink()
        self.close()

    @property
    def mapping(self) -> mmap.mmap:
        """The whole segment, header included: what a transfer engine registers (remote/transfer.py)."""
        return self._mm

    @staticmethod
    def payload_position(offset: int) -> int:
        """Where, in the segment, the payload of the record at `offset` starts."""
        return HEADER_SIZE + offset + RECORD_HEADER

    # -- producer side ------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self._capacity

    def reserve(self, nbytes: int, timeout: float = 0.0) -> Reservation:
        """Claim room for an nbytes payload, waiting up to timeout seconds; RingFull past the deadline."""
        cap = self.capacity
        span = _align(RECORD_HEADER + nbytes)
        if nbytes < 0 or span > cap:
            raise RingFull(f"a {nbytes}-byte record can never fit a {cap}-byte ring")
        self._wrote = True
        deadline = time.monotonic() + timeout
        delay = 50e-6
        while True:
            with self._locked():  # producers claim in turn; the lock is not held while waiting for room
                reservation = self._claim(nbytes, span)
                if reservation is None and self._advance_tail():
                    reservation = self._claim(nbytes, span)
                used = self._q[_H_HEAD] - self._q[_H_TAIL]
            if reservation is not None:
                return reservation
            now = time.monotonic()
            if now >= deadline:
                raise RingFull(f"{used} of {cap} bytes in use; no room for {span} more within {timeout:g}s")
            time.sleep(min(delay, deadline - now))
            delay = min(delay * 2, 2e-3)

    def _claim(self, nbytes: int, span: int) -> Reservation | None:
        """A record of span bytes at the head, if there is room now (under the lock)."""
        q, cap = self._q, self.capacity
        head, tail = q[_H_HEAD], q[_H_TAIL]
        off = head % cap
        pad = cap - off if off + span > cap else 0  # records stay contiguous: skip to offset 0
        if cap - (head - tail) < pad + span:
            return None
        me = os.getpid()
        if pad:
            self._write_header(off, PAD, me, pad - RECORD_HEADER, 0)
            head += pad
            q[_H_HEAD] = head
            off = 0
        seq = q[_H_SEQ]
        q[_H_SEQ] = seq + 1
        self._write_header(off, RESERVED, me, nbytes, seq)
        q[_H_HEAD] = head + span  # header first, then head: every record in [tail, head) has one
        q[_H_WRITER] = me  # the latest writer (the status shows it)
        base = HEADER_SIZE + off + RECORD_HEADER
        return Reservation(self, off, nbytes, seq, self._view[base:base + nbytes])

    def write(self, data, timeout: float = 0.0) -> int:
        """Copy data into a new record and commit it; returns the offset."""
        src = memoryview(data).cast("B")
        res = self.reserve(src.nbytes, timeout)
        res.view[:] = src
        return res.commit()

    # -- consumer side ------------------------------------------------------------------------

    def read(self, offset: int, seq: int | None = None) -> memoryview:
        """A read-only view of the committed record's payload at offset (no copy).

        Pass the seq the producer reported to make sure the offset still holds that record.
        """
        state, _, length, found_seq, gen = self._header(offset)
        if gen != self._q[_H_GENERATION]:
            raise StaleRecord(f"offset {offset} is from generation {gen}, the ring is at "
                              f"{self._q[_H_GENERATION]}")
        if state != COMMITTED:
            raise RingError(f"no committed record at offset {offset} (state {_state_name(state)})")
        if seq is not None and seq != found_seq:
            raise StaleRecord(f"offset {offset} holds record {found_seq}, not {seq}")
        self._reads += 1
        base = HEADER_SIZE + offset + RECORD_HEADER
        return self._view[base:base + length].toreadonly()

    def release(self, offset: int) -> None:
        """Done with the record at offset; the tail moves past every released record in order."""
        with self._locked():
            state, _, _, _, gen = self._header(offset)
            if gen != self._q[_H_GENERATION]:
                raise StaleRecord(f"offset {offset} is from generation {gen}")
            if state != COMMITTED:
                raise RingError(f"cannot release offset {offset}: state {_state_name(state)}")
            self._set_state(offset, RELEASED)
            self._advance_tail()

    def reclaim(self) -> int:
        """Move the tail past released records and dead producers' uncommitted ones; bytes freed."""
        with self._locked():
            return self._advance_tail()

    def reset(self) -> None:
        """Owner only, once it knows the producer is gone: drop every record and start a new generation."""
        with self._locked():
            q = self._q
            pending = sum(1 for r in self.records() if r.state in ("reserved", "committed"))
            q[_H_SKIPPED] += pending
            q[_H_HEAD] = q[_H_TAIL] = 0
            q[_H_WRITER] = 0
            q[_H_GENERATION] += 1

    def records(self) -> Iterator[RecordInfo]:
        """The records between tail and head, pads included, oldest first."""
        q, cap = self._q, self.capacity
        pos, head = q[_H_TAIL], q[_H_HEAD]
        while pos < head:
            off = pos % cap
            state, pid, length, seq, _ = self._header(off)
            yield RecordInfo(off, length, seq, pid, _state_name(state))
            pos += _align(RECORD_HEADER + length)

    def stats(self) -> RingStats:
        q = self._q
        used = q[_H_HEAD] - q[_H_TAIL]
        return RingStats(
            capacity=q[_H_CAPACITY], used_bytes=used, free_bytes=q[_H_CAPACITY] - used,
            generation=q[_H_GENERATION], records_written=q[_H_WRITTEN], bytes_written=q[_H_BYTES],
            records_released=q[_H_RELEASED], records_skipped=q[_H_SKIPPED], records_read=self._reads,
            owner_pid=q[_H_OWNER], writer_pid=q[_H_WRITER])

    # -- internals ----------------------------------------------------------------------------

    @contextmanager
    def _locked(self):
        # flock orders processes (each opened the file itself); the thread lock orders this handle's threads
        if os.getpid() != self._pid:
            raise RingError("ring handle inherited across fork: attach() again in the child")
        with self._thread_lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _advance_tail(self) -> int:
        q, i, cap = self._q, self._i, self.capacity
        start = tail = q[_H_TAIL]
        head = q[_H_HEAD]
        released = skipped = 0
        while tail < head:
            off = tail % cap
            state, pid, length, _, _ = self._header(off)
            if state == RELEASED:
                released += 1
            elif state == RESERVED and not _pid_alive(pid):
                i[(HEADER_SIZE + off) // 4] = ABANDONED
                skipped += 1
            elif state == ABANDONED:
                skipped += 1
            elif state != PAD:
                if state not in _STATE_NAMES:
                    raise RingError(f"{self.path}: corrupt record header at offset {off}; reset() the ring")
                break
            tail += _align(RECORD_HEADER + length)
        q[_H_TAIL] = tail
        q[_H_RELEASED] += released
        q[_H_SKIPPED] += skipped
        return tail - start

    def _check_offset(self, offset: int) -> int:
        if not 0 <= offset <= self.capacity - RECORD_HEADER or offset % ALIGN:
            raise RingError(f"offset {offset} is not a record offset in a {self.capacity}-byte ring")
        return HEADER_SIZE + offset

    def _header(self, offset: int) -> tuple[int, int, int, int, int]:
        base = self._check_offset(offset)
        i, q = base // 4, base // 8
        return self._i[i], self._i[i + 1], self._q[q + 1], self._q[q + 2], self._q[q + 3]

    def _write_header(self, offset: int, state: int, pid: int, length: int, seq: int) -> None:
        base = HEADER_SIZE + offset
        q = base // 8
        self._q[q + 1] = length
        self._q[q + 2] = seq
        self._q[q + 3] = self._q[_H_GENERATION]
        self._i[base // 4 + 1] = pid
        self._i[base // 4] = state

    def _set_state(self, offset: int, state: int) -> None:
        # The commit word is a single aligned 4-byte store after the payload stores. That ordering is
        # what a scan of the ring relies on; consumers learn offsets over the control channel, whose
        # syscalls order memory as well, and the record's own checksum catches anything else.
        self._i[self._check_offset(offset) // 4] = state

    def _count_commit(self, nbytes: int) -> None:
        with self._locked():  # several producers may commit at once
            self._q[_H_WRITTEN] += 1
            self._q[_H_BYTES] += nbytes


def _state_name(state: int) -> str:
    return _STATE_NAMES.get(state, f"0x{state:08x}")


def sweep_stale(instance_prefix: str = "syshax-", *,
                directory: str | os.PathLike = DEFAULT_DIRECTORY) -> list[Path]:
    """Remove ring segments whose owner pid is dead (left by a daemon killed with -9); returns them."""
    return sweep_segments(f"{instance_prefix}*-kv", MAGIC, 8 * _H_OWNER, directory)


def sweep_segments(pattern: str, magic: bytes, owner_at: int, directory: str | os.PathLike) -> list[Path]:
    """Remove the shared-memory segments matching pattern whose header (magic first, the owner's pid as a u64
    at owner_at) names a dead owner; returns them. Both the ring and the prefix cache's store use it."""
    removed = []
    for path in sorted(Path(directory).glob(pattern)):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            head = os.pread(fd, owner_at + 8, 0)
        finally:
            os.close(fd)
        if len(head) < owner_at + 8 or head[:len(magic)] != magic:
            continue  # not ours, or still being created
        (owner,) = struct.unpack_from("<Q", head, owner_at)
        if not _pid_alive(owner):
            try:
                path.unlink()
                removed.append(path)
            except FileNotFoundError:
                pass
    return removed
