"""The prefix cache's disk tier: blocks kept in files, so that a prompt seen before is a hit after shared memory
evicted its blocks or the daemon restarted.

Write-through: each block the shared-memory tier indexes as written (engine/prefix_cache.py) is copied to a file
by a writer thread, off the event loop and off every engine's step. A block evicted from shared memory then costs
nothing to keep, and a restart finds what was kept. Before a prompt is planned, the blocks it starts with that
only the disk holds are read back into slots of the block store (`read_into`, in a thread), where the engines read
them as any other block.

Files live in prefix_cache_dir/<identity>/, one per block, named by the block's chained key. The identity hashes
what decides a block's bits: the model file (its KV fingerprint, size and sampled bytes), the block and chunk sizes,
and the engines' build and kernels, which they report when they are ready. Folders of other identities are removed
when the tier opens, and counted. Each file repeats its identity and key and carries the KV record, whose own
checksum is checked at every read: a file that fails is deleted and its block computed again, never served.

One owner: the writer thread adds files and evicts the least recently used past the budget; reads and `clear`
take the same lock for the index. Only the daemon's process touches the folder.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import shutil
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import xxhash

from syshaxd.sdk.kv.block_store import BlockStore
from syshaxd.sdk.kv.record import RecordError, decode

log = logging.getLogger(__name__)

MAGIC = b"SYSHAXPD"
VERSION = 1
_HEADER = struct.Struct("<8sQQQQ")  # magic, version, identity, block key, the record's checksum
MODEL_SAMPLES = 64  # pieces of the model file hashed into its identity
MODEL_SAMPLE_BYTES = 64 * 1024
_KEY_NAME = re.compile(r"[0-9a-f]{16}")  # a block file's name (its key), and an identity folder's
FREE_SHARE = 0.5  # of the file system's free space at open, the most the tier takes when that is under its budget


@dataclass(frozen=True)
class DiskStatus:
    """The disk tier's state and counters, for /v1/syshax/status, `syshax status` and /metrics."""

    directory: str
    state: str  # "waiting" (for a ready engine to name its kernels), "open", or "off: why"
    capacity_bytes: int
    bytes: int  # of the block files held
    blocks: int
    written: int  # blocks written to disk
    bytes_written: int
    loaded: int  # blocks read back into shared memory for a prompt
    bytes_read: int
    evictions: int  # files removed to stay within the budget
    corrupt: int  # files that failed their checks when read (deleted; their blocks recomputed)
    discarded: int  # files of another model, build or block size, removed when the tier opened
    missed: int  # blocks shared memory reused before the writer copied them (not kept on disk)


def model_identity(path: Path, fingerprint: bytes) -> str:
    """The model file's identity: its KV fingerprint, size, and a hash of MODEL_SAMPLES pieces spread over it, so
    that another file with the same tensor table (a fine-tune of the same shape) is another identity."""
    h = xxhash.xxh3_64(fingerprint)
    size = path.stat().st_size
    h.update(size.to_bytes(8, "little"))
    with open(path, "rb") as fh:
        for i in range(MODEL_SAMPLES):
            fh.seek(i * max(0, size - MODEL_SAMPLE_BYTES) // max(1, MODEL_SAMPLES - 1))
            h.update(fh.read(MODEL_SAMPLE_BYTES))
    return h.hexdigest()


def identity_of(model: str, block_tokens: int, chunk_tokens: int, engine: dict) -> str:
    """The folder name for blocks made by engines reporting `engine` (their info) from model identity `model`.

    What changes a block's bits: the library's build, the kernels it chose, repacking, the attention's tiling,
    the weight types, and the chunk grid blocks are computed on."""
    parts = [model, str(block_tokens), str(chunk_tokens)]
    parts += [str(engine.get(k, "")) for k in ("backend", "build", "kernels", "repack", "attention", "weight_types")]
    return xxhash.xxh3_64_hexdigest("\0".join(parts).encode())


class DiskTier:
    """Block files under `directory`, at most `budget` bytes; copies slots of `store` out and reads files into them."""

    def __init__(self, directory: Path, budget: int, store: BlockStore, model: str, block_tokens: int,
                 chunk_tokens: int) -> None:
        self.directory = directory
        self.budget = budget
        self.store = store
        self.model, self.block_tokens, self.chunk_tokens = model, block_tokens, chunk_tokens
        self.identity = ""
        self.state = "waiting"
        self._folder: Path | None = None
        self._files: OrderedDict[int, int] = OrderedDict()  # key -> file bytes, least recently used first
        self._used = 0  # bytes of the files in _files
        self._lock = threading.Lock()  # the index (_files, _used, the counters)
        self._opening = threading.Lock()  # engines report ready at once: one opens the tier
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self.written = self.bytes_written = self.loaded = self.bytes_read = 0
        self.evictions = self.corrupt = self.discarded = self.missed = 0

    # --- opening and closing ------------------------------------------------------------------------

    def open_for(self, engine: dict) -> None:
        """Open the tier for blocks the engine reporting `engine` makes (blocking: run it in a thread). A tier
        already open for another identity turns off: its engines disagree on the bits of a block."""
        with self._opening:
            self._open_for(engine)

    def _open_for(self, engine: dict) -> None:
        identity = identity_of(self.model, self.block_tokens, self.chunk_tokens, engine)
        if self.state == "open":
            if identity != self.identity:
                self.turn_off(f"engine {engine.get('name', '?')} computes blocks with other kernels "
                              f"({engine.get('kernels')}) than the ones the disk tier was opened for")
            return
        if self.state != "waiting":
            return
        try:
            self._open(identity)
        except OSError as exc:
            self.turn_off(f"{self.directory}: {exc.strerror or exc}")

    def _open(self, identity: str) -> None:
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        for entry in os.scandir(self.directory):
            # only folders of block files go: prefix_cache_dir may be a folder that holds other things too
            if entry.name != identity and entry.is_dir(follow_symlinks=False) and _block_folder(entry.path):
                for block in os.scandir(entry.path):
                    _unlink(Path(block.path))
                    self.discarded += 1
                try:
                    os.rmdir(entry.path)
                except OSError:
                    pass
        if self.discarded:
            log.warning("prefix cache on disk: removed %d blocks of another model, build or block size from %s",
                        self.discarded, self.directory)
        folder = self.directory / identity
        folder.mkdir(exist_ok=True, mode=0o700)
        found = []
        for entry in os.scandir(folder):
            if entry.name.endswith(".tmp"):  # a writer's temporary file, left by a crash
                _unlink(Path(entry.path))
                continue
            if not _KEY_NAME.fullmatch(entry.name):
                continue  # not ours: left alone
            try:
                key = int(entry.name, 16)
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            found.append((st.st_mtime_ns, key, st.st_size))
        free = shutil.disk_usage(folder).free + sum(size for _, _, size in found)
        if free * FREE_SHARE < self.budget:
            log.warning("prefix cache on disk: %s has %.1f GiB free; keeping at most %.1f GiB there, not "
                        "prefix_cache_disk_gb's %.1f", folder, free / 2**30, free * FREE_SHARE / 2**30,
                        self.budget / 2**30)
            self.budget = int(free * FREE_SHARE)
        with self._lock:
            for _, key, size in sorted(found):
                self._files[key] = size
                self._used += size
            self._evict()
        self._folder, self.identity, self.state = folder, identity, "open"
        self._writer = threading.Thread(target=self._write_loop, name="prefix-disk-writer", daemon=True)
        self._writer.start()
        log.info("prefix cache on disk: %d blocks (%.0f MiB) kept from before in %s; up to %.1f GiB",
                 len(self._files), self.used() / 2**20, folder, self.budget / 2**30)

    def turn_off(self, why: str) -> None:
        if self.state.startswith("off"):
            return
        log.warning("prefix cache on disk: off: %s", why)
        self.state = f"off: {why}"
        self.close()

    def close(self) -> None:
        """Stop the writer once it has written what is queued (blocks written before a stop survive it)."""
        if self._writer is not None:
            self._jobs.put(None)
            self._writer.join(timeout=30)
            self._writer = None

    # --- what the shared-memory tier asks -------------------------------------------------------------

    @property
    def is_open(self) -> bool:
        return self.state == "open"

    def has(self, key: int) -> bool:
        return key in self._files

    def keep(self, key: int, slot: int, checksum: int) -> None:
        """Copy the block in `slot` (written and sealed with `checksum`) to a file, soon, in the writer thread."""
        if self.is_open:
            self._jobs.put((key, slot, checksum))

    def read_into(self, key: int, slot: int) -> int | None:
        """Read block `key`'s file into `slot` of the store (blocking: run it in a thread); its record's checksum,
        or None when the file is gone or fails its checks (then deleted)."""
        if self._folder is None or key not in self._files:
            return None
        path = self._folder / f"{key:016x}"
        try:
            data = path.read_bytes()
        except OSError:
            with self._lock:
                self._used -= self._files.pop(key, 0)
            return None
        why = _check(data, self.identity, key)
        view = self.store.slot(slot)
        if not why and len(data) - _HEADER.size > len(view):
            why = f"its record of {len(data) - _HEADER.size} bytes is larger than a slot ({len(view)})"
        if why:
            log.warning("prefix cache on disk: block %016x cannot be used (%s); deleted, its tokens are computed "
                        "again", key, why)
            with self._lock:
                if key in self._files:
                    self._used -= self._files.pop(key)
                    self.corrupt += 1
            _unlink(path)
            return None
        view[:len(data) - _HEADER.size] = memoryview(data)[_HEADER.size:]
        with self._lock:
            if key in self._files:
                self._files.move_to_end(key)
            self.loaded += 1
            self.bytes_read += len(data)
        return _HEADER.unpack_from(data)[4]

    def clear(self) -> int:
        """Delete every block file; how many there were."""
        with self._lock:
            keys = list(self._files)
            self._files.clear()
            self._used = 0
        if self._folder is not None:
            for key in keys:
                _unlink(self._folder / f"{key:016x}")
        return len(keys)

    def used(self) -> int:
        return self._used

    def status(self) -> DiskStatus:
        with self._lock:
            used, n = self._used, len(self._files)
        return DiskStatus(str(self.directory), self.state, self.budget, used, n, self.written, self.bytes_written,
                          self.loaded, self.bytes_read, self.evictions, self.corrupt, self.discarded, self.missed)

    # --- the writer thread ------------------------------------------------------------------------------

    def _write_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._write(*job)
            except OSError as exc:  # a full or read-only disk: shared memory goes on serving
                log.warning("prefix cache on disk: cannot write a block (%s)", exc.strerror or exc)
            except Exception:  # never let the writer die silently: the tier would stop keeping anything
                log.exception("prefix cache on disk: writing a block failed")

    def _write(self, key: int, slot: int, checksum: int) -> None:
        if key in self._files:
            with self._lock:
                if key in self._files:
                    self._files.move_to_end(key)
            return
        view = self.store.slot(slot)
        (total,) = struct.unpack_from("<Q", view, 32)  # the record's size (sdk/kv/record.py's header)
        data = bytes(view[:min(total, len(view))])
        try:  # the slot may have been given to another block since: keep only the record that was reported
            if decode(data).checksum != checksum:
                raise RecordError("another record")
        except RecordError:
            self.missed += 1
            return
        assert self._folder is not None
        head = _HEADER.pack(MAGIC, VERSION, int(self.identity, 16), key, checksum)
        path = self._folder / f"{key:016x}"
        temporary = path.with_name(path.name + ".tmp")
        with open(temporary, "wb") as fh:
            fh.write(head)
            fh.write(data)
        os.replace(temporary, path)
        with self._lock:
            self._used += len(head) + len(data) - self._files.get(key, 0)
            self._files[key] = len(head) + len(data)
            self.written += 1
            self.bytes_written += len(head) + len(data)
            self._evict()

    def _evict(self) -> None:
        """Remove the least recently used files past the budget (the lock held)."""
        while self._used > self.budget and self._files:
            key, size = self._files.popitem(last=False)
            self._used -= size
            self.evictions += 1
            if self._folder is not None:
                _unlink(self._folder / f"{key:016x}")


def _block_folder(path: str) -> bool:
    """Whether `path` is a folder this tier wrote: an identity's name, holding only block files (and temporary
    ones)."""
    if not _KEY_NAME.fullmatch(os.path.basename(path)):
        return False
    try:
        return all(entry.is_file(follow_symlinks=False) and _KEY_NAME.fullmatch(entry.name.removesuffix(".tmp"))
                   for entry in os.scandir(path))
    except OSError:
        return False


def _check(data: bytes, identity: str, key: int) -> str:
    """Why a block file's bytes cannot be used ("" when they can)."""
    if len(data) < _HEADER.size:
        return "shorter than its header"
    magic, version, ident, stored_key, checksum = _HEADER.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        return "not a block file of this version"
    if ident != int(identity, 16) or stored_key != key:
        return "another model's, build's or block's"
    try:
        record = decode(memoryview(data)[_HEADER.size:])
    except RecordError as exc:
        return str(exc)
    return "" if record.checksum == checksum else "its record is not the one written"


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
