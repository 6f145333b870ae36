"""The prefix cache's memory: a shared-memory segment of slots, each holding one block's KV record.

Two sizes of slot: `n_slots` of `slot_bytes` for blocks, then `n_wide` of `wide_bytes` for whole prompts'
last chunks with their last token's logits (engine/prefix_cache.py); slot numbers run on across both.

The daemon creates it (0600, in /dev/shm beside the ring) and decides what each slot holds
(engine/prefix_cache.py); engine workers attach it, read the blocks the daemon says a prompt may
reuse, and write the blocks it tells them to. A slot's content is a neutral KV record (kv/record.py),
so its own checksum and token ids say whether it is what the daemon believes. Pages are touched
only when a block is written: an empty cache costs no memory.
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

from syshaxd.sdk.kv.ring import DEFAULT_DIRECTORY, sweep_segments

MAGIC = b"SYSHAXPC"
VERSION = 2
HEADER_SIZE = 4096
_HEADER = struct.Struct("<8sQQQQQQ")  # magic, version, owner pid, slots, slot bytes, wide slots, wide slot bytes
_OWNER_AT = struct.calcsize("<8sQ")


class StoreError(Exception):
    """The segment is missing, not a block store, or of another version."""


def store_path(instance: str, directory: str | os.PathLike = DEFAULT_DIRECTORY) -> Path:
    if not instance or "/" in instance or instance.startswith("."):
        raise ValueError(f"instance={instance!r}: must be a non-empty name without '/' or a leading '.'")
    return Path(directory) / f"syshax-{instance}-prefix"


class BlockStore:
    """A handle on one block store: create() in the daemon, attach() in the workers."""

    def __init__(self, path: Path, fd: int, n_slots: int, slot_bytes: int, n_wide: int = 0,
                 wide_bytes: int = 0) -> None:
        self.path = path
        self.n_slots = n_slots
        self.slot_bytes = slot_bytes
        self.n_wide = n_wide
        self.wide_bytes = wide_bytes
        self._fd = fd
        self._mm = mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._view = memoryview(self._mm)

    @classmethod
    def create(cls, instance: str, n_slots: int, slot_bytes: int, n_wide: int = 0, wide_bytes: int = 0, *,
               directory: str | os.PathLike = DEFAULT_DIRECTORY) -> "BlockStore":
        if n_slots < 1 or slot_bytes < 64 or slot_bytes % 64:
            raise ValueError(f"n_slots={n_slots}, slot_bytes={slot_bytes}: need a slot or more of 64-byte multiples")
        if n_wide < 0 or (n_wide and (wide_bytes < 64 or wide_bytes % 64)):
            raise ValueError(f"n_wide={n_wide}, wide_bytes={wide_bytes}: wide slots are 64-byte multiples")
        path = store_path(instance, directory)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.fchmod(fd, 0o600)  # exact mode whatever the umask
            # sparse: pages come as blocks are written
            os.ftruncate(fd, HEADER_SIZE + n_slots * slot_bytes + n_wide * wide_bytes)
            os.pwrite(fd, _HEADER.pack(MAGIC, VERSION, os.getpid(), n_slots, slot_bytes, n_wide, wide_bytes), 0)
            return cls(path, fd, n_slots, slot_bytes, n_wide, wide_bytes)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise

    @classmethod
    def attach(cls, instance: str, *, directory: str | os.PathLike = DEFAULT_DIRECTORY) -> "BlockStore":
        path = store_path(instance, directory)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise StoreError(f"{path}: no prefix cache segment (the daemon creates it at start)") from None
        try:
            magic, version, _owner, n_slots, slot_bytes, n_wide, wide_bytes = _HEADER.unpack(
                os.pread(fd, _HEADER.size, 0))
            if magic != MAGIC:
                raise StoreError(f"{path} is not a syshax prefix cache segment")
            if version != VERSION:
                raise StoreError(f"{path}: store version {version}, this code reads version {VERSION}")
            if os.fstat(fd).st_size != HEADER_SIZE + n_slots * slot_bytes + n_wide * wide_bytes:
                raise StoreError(f"{path}: the file is not the {n_slots} x {slot_bytes} + {n_wide} x {wide_bytes} "
                                 "bytes its header says")
            return cls(path, fd, n_slots, slot_bytes, n_wide, wide_bytes)
        except BaseException:
            os.close(fd)
            raise

    def slot(self, index: int) -> memoryview:
        """The bytes of slot `index` (writable; a view into the shared segment): a block slot below n_slots, a
        wide one from there."""
        if 0 <= index < self.n_slots:
            start = HEADER_SIZE + index * self.slot_bytes
            return self._view[start:start + self.slot_bytes]
        if self.n_slots <= index < self.n_slots + self.n_wide:
            start = HEADER_SIZE + self.n_slots * self.slot_bytes + (index - self.n_slots) * self.wide_bytes
            return self._view[start:start + self.wide_bytes]
        raise IndexError(f"slot {index} is not in 0..{self.n_slots + self.n_wide - 1}")

    def close(self) -> None:
        if self._fd < 0:
            return
        self._view.release()
        try:
            self._mm.close()
        except BufferError:
            pass  # a record view still points in; the mapping goes with the last one
        os.close(self._fd)
        self._fd = -1

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def sweep_stale(directory: str | os.PathLike = DEFAULT_DIRECTORY) -> list[Path]:
    """Remove block stores whose owner pid is dead (a daemon killed with -9); returns them."""
    return sweep_segments("syshax-*-prefix", MAGIC, _OWNER_AT, directory)
