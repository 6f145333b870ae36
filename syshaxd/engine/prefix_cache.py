"""Automatic prefix caching: which prompt blocks the block store holds, who uses each, which goes next.

vLLM's scheme, for llama.cpp engines: a prompt's tokens are cut into blocks of `block_tokens` (16 by
default, dividing the prefill chunk); block j is known by a hash chained over blocks 0..j, so a block
matches only when everything before it matches too. A new prompt reuses its longest run of cached
blocks from the start, and the engine evaluates the rest. The engine decides how much of that run it
can resume after and still give the tokens a miss gives (a prompt chunk's bits do not depend on where
it starts once it holds enough tokens; the engine proves that at its warm-up), and which of its new
blocks it can keep (plugins/llamacpp/syshax_llamacpp/prefix.py).

A whole prompt is kept too: its last chunk (from the last multiple of the chunk size before its last
token) with its last token's logits, in a wide slot of its own, so that the same prompt again runs
nothing at all.

And what a request generates, where its engine computes a token's KV with the same bits decoding as a
prompt chunk (the engine proves that at its warm-up): the plan holds free slots for those blocks
(`keeps`, up to `keep_tokens` of them), the engine fills them when the request ends and names each
by its key over the prompt and the generated tokens, and the slots it did not fill are freed. A
chat's next turn, which sends the answer back, then resumes after it, as llama-server's slot does.

The daemon's KV ledger owns this index; the engine workers only read and write the slots it names
(kv/block_store.py). A block is held by each request planned to read or write it, from the plan until
the engine reports (Cached) or the request ends; a held block is never evicted. Blocks nobody holds
wait in LRU order and go when a slot of their size is needed. A hash matched by mistake costs nothing
but time: the engine checks each record's checksum and token ids before using it.

With a disk tier (engine/prefix_disk.py) every block written is copied to a file too, and before a prompt is
planned the blocks it starts with that only the disk still holds are read back into slots (`from_disk`, then
`loaded`), as blocks nobody holds: the plan then finds them as it finds any other.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import xxhash

from syshaxd.engine.prefix_disk import DiskStatus, DiskTier
from syshaxd.sdk.kv.block_keys import block_keys
from syshaxd.sdk.types import Cached, PrefixPlan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefixStatus:
    """The prefix cache's state and counters (vLLM's prefix_cache_queries / prefix_cache_hits are tokens)."""

    block_tokens: int
    capacity_blocks: int
    capacity_bytes: int  # block slots and wide slots together
    blocks: int  # blocks cached and usable
    bytes: int  # of the blocks and whole prompts kept
    held: int  # blocks a request is reading or writing now
    queries: int  # prompt tokens looked up
    hits: int  # of those, tokens whose KV an engine took from the cache
    stored: int  # blocks written
    evictions: int
    refused: int  # blocks an engine found unusable (never seen in a sound run)
    capacity_prompts: int = 0  # wide slots: whole prompts' last chunks with their logits
    prompts: int = 0  # whole prompts kept
    generated: int = 0  # blocks of generated tokens written (of `stored`)
    disk: DiskStatus | None = None  # the disk tier (prefix_cache_disk_gb), where there is one


@dataclass(eq=False)
class _Block:
    key: int  # hash of this block's tokens chained after its parent's key
    slot: int
    ready: bool = False  # written and reported; until then only its writer knows it
    checksum: int = 0
    dead: bool = False  # found unusable: out of the index, its slot freed when unheld
    holders: set[str] = field(default_factory=set)
    wide: bool = False  # a whole prompt's last chunk and logits, in a wide slot


@dataclass(frozen=True)
class DiskRead:
    """PrefixCache.from_disk's answer: the blocks to read back into their slots, and those being read already."""

    taken: list[tuple[int, int]]  # (key, slot)
    waits: list[int]  # keys another prompt's read is bringing back


KEEPS_SHARE = 4  # the block slots held for what requests in flight generate: at most 1 / KEEPS_SHARE of them


class _Slots:
    """One size of slot: the free ones, and the ready blocks nobody holds, least recently used first."""

    def __init__(self, first: int, n: int, nbytes: int) -> None:
        self.n = n
        self.nbytes = nbytes
        self.free = list(range(first + n - 1, first - 1, -1))
        self.idle: OrderedDict[int, _Block] = OrderedDict()


def final_key(tokens, chunk_tokens: int, block_tokens: int, keys: list[int]) -> int:
    """The key of a whole prompt: its blocks before the chunk holding its last token, and that chunk's tokens."""
    ids = np.asarray(tokens, dtype=np.int32)
    start = final_start(len(ids), chunk_tokens)
    parent = keys[start // block_tokens - 1] if start else 0
    return xxhash.xxh3_64_intdigest(b"final" + parent.to_bytes(8, "little") + ids[start:].tobytes())


def final_start(n_tokens: int, chunk_tokens: int) -> int:
    """Where the chunk that holds a prompt's last token starts, as a prompt run from the start cuts it."""
    return (n_tokens - 1) // chunk_tokens * chunk_tokens


class PrefixCache:
    def __init__(self, n_slots: int, block_tokens: int, slot_bytes: int, *, chunk_tokens: int | None = None,
                 n_wide: int = 0, wide_bytes: int = 0, keep_tokens: int = 0) -> None:
        """n_slots block slots (0..n_slots-1), then n_wide wide slots for whole prompts; with no wide slots,
        whole prompts take block slots (the index's tests size every slot alike). keep_tokens: the most generated
        tokens a request may keep (0: none)."""
        self.block_tokens = block_tokens
        self.keep_tokens = keep_tokens
        self.chunk_tokens = chunk_tokens or block_tokens
        if self.chunk_tokens % block_tokens:
            raise ValueError(f"a block of {block_tokens} tokens does not divide a chunk of {self.chunk_tokens}")
        self._blocks = _Slots(0, n_slots, slot_bytes)
        self._wide = _Slots(n_slots, n_wide, wide_bytes) if n_wide else self._blocks
        self._by_key: dict[int, _Block] = {}
        self._by_slot: dict[int, _Block] = {}
        self._held: dict[str, list[_Block]] = {}  # request id -> the blocks its plan holds
        self._keeps: dict[str, list[int]] = {}  # request id -> slots held for blocks of what it generates
        self.queries = self.hits = self.stored_blocks = self.evictions = self.refused = self.generated = 0
        self.disk: DiskTier | None = None  # block files, where prefix_cache_disk_gb asks for them
        self._loading: set[int] = set()  # keys being read back from disk

    def plan(self, request_id: str, tokens, generate: int = 0) -> PrefixPlan:
        """The cached blocks the prompt starts with, and free slots for its other whole blocks (held for it).

        Blocks stop before the block that holds the prompt's last token: its logits give the first token.
        The chunk holding that token and those logits are kept as one more entry, for this very prompt
        (`final`), usable once the hits reach that chunk's start. `generate`: the most tokens the request may
        generate; slots for the whole blocks they may fill, up to keep_tokens, are held for it (`keeps`).
        """
        c = self.block_tokens
        keys = block_keys(tokens, c)
        usable = (len(tokens) - 1) // c
        held = self._held.setdefault(request_id, [])
        hits = []
        for key in keys[:usable]:
            block = self._by_key.get(key)
            if block is None:
                break
            # a block still being written for another request is planned too: prompts run one at a time
            # in an engine, so it is usually there by the time this one runs (the engine checks)
            hits.append(block)
        for block in hits:  # held first: making room for this prompt's new blocks must not evict them
            self._hold(block, request_id, held)
        # the whole prompt (its last chunk and last token's logits), when every block before that chunk is cached
        before = final_start(len(tokens), self.chunk_tokens) // c
        key = final_key(tokens, self.chunk_tokens, c, keys)
        final, final_store = None, -1
        whole = self._by_key.get(key)
        if whole is not None and len(hits) >= before:
            self._hold(whole, request_id, held)
            final = (whole.slot, whole.checksum if whole.ready else 0)
        stores = []
        for index in range(len(hits), len(keys)):
            if keys[index] in self._by_key:
                continue  # cached, or being written for another request
            slot = self._new_block(keys[index], request_id, held, self._blocks)
            if slot < 0:
                break  # every slot is in use: the rest of this prompt is not kept
            stores.append((index, slot))
        if whole is None and all(k in self._by_key for k in keys[:before]):
            final_store = self._new_block(key, request_id, held, self._wide, wide=True)
        self.queries += len(tokens)
        return PrefixPlan(c, self.chunk_tokens, tuple((b.slot, b.checksum if b.ready else 0) for b in hits),
                          tuple(stores), final, final_store, self._keep(request_id, len(tokens), generate))

    def _keep(self, request_id: str, n_prompt: int, generate: int) -> tuple[int, ...]:
        """Slots for the blocks after the prompt's whole ones that the KV of what it generates may fill (the
        last generated token is never evaluated), up to keep_tokens' worth; held for the request.

        Slots are held from the plan on, and taking one may evict an idle block, so all requests together hold
        at most a quarter of the block slots this way: with a large model's blocks (2 MB for 16 tokens of an 8B
        model) a small cache would otherwise give every slot to the answers in flight and keep no prompts."""
        c = self.block_tokens
        n = min((n_prompt + generate - 1) // c - n_prompt // c, self.keep_tokens // c) if generate > 0 else 0
        slots = self._keeps.setdefault(request_id, [])
        room = self._blocks.n // KEEPS_SHARE - sum(len(held) for held in self._keeps.values())
        n = min(n, len(slots) + max(0, room))
        while len(slots) < n and (slot := self._take_slot(self._blocks)) is not None:
            slots.append(slot)
        return tuple(slots)

    def cached(self, event: Cached) -> None:
        """The engine wrote the blocks it reports, took `hit_tokens` from the cache, and needs no block of the
        plan any more; or, at the request's end, wrote blocks of what it generated into its `keeps` slots."""
        if event.generated is not None:
            self._kept(event.request_id, event.generated)
            return
        self.hits += event.hit_tokens
        for slot, checksum in event.stored:
            block = self._by_slot.get(slot)
            if block is not None and event.request_id in block.holders and not block.ready:
                block.ready, block.checksum = True, checksum
                self.stored_blocks += 1
                if self.disk is not None and not block.wide:
                    self.disk.keep(block.key, slot, checksum)
        for slot in event.refused:
            block = self._by_slot.get(slot)
            if block is not None and not block.dead:
                log.error("prefix cache: an engine found the block in slot %d unusable; dropping it", slot)
                self.refused += 1
                block.dead = True
                if self._by_key.get(block.key) is block:
                    del self._by_key[block.key]
        self._release_holds(event.request_id)

    def _kept(self, request_id: str, generated) -> None:
        """Index the blocks of generated tokens written into the request's keeps slots (idle from now on, as
        blocks nobody holds); a block another request kept meanwhile wins. The slots left unwritten are freed."""
        slots = self._keeps.pop(request_id, [])
        for slot, key, checksum in generated:
            if slot not in slots or key in self._by_key:
                continue
            slots.remove(slot)
            block = self._by_key[key] = self._by_slot[slot] = _Block(key, slot, True, checksum)
            self._blocks.idle[key] = block
            self.stored_blocks += 1
            self.generated += 1
            if self.disk is not None:
                self.disk.keep(key, slot, checksum)
        self._blocks.free += slots

    def from_disk(self, tokens) -> DiskRead:
        """What to read back from the disk tier for a prompt: (key, slot) of each block it starts with that only the
        disk holds, up to the first block no tier holds, with a slot taken for each (read them in with
        DiskTier.read_into, then report `loaded`); and the keys of its blocks another prompt is reading back now
        (wait for those reads before planning: prompts that share a prefix arrive together).

        The prompt's blocks in shared memory become the most recently used first, and the slots taken are at most
        those free or idle beside them, so that reading the later blocks in never evicts the earlier ones."""
        if self.disk is None or not self.disk.is_open:
            return DiskRead([], [])
        c = self.block_tokens
        keys = block_keys(tokens, c)[:(len(tokens) - 1) // c]
        wanted, waits, mine = [], [], 0
        for key in keys:
            block = self._by_key.get(key)
            if block is not None:
                if block.key in self._blocks.idle:
                    self._blocks.idle.move_to_end(block.key)
                    mine += 1
            elif key in self._loading:
                waits.append(key)
            elif self.disk.has(key):
                wanted.append(key)
            else:
                break
        room = len(self._blocks.free) + len(self._blocks.idle) - mine
        taken = []
        for key in wanted[:max(0, room)]:
            slot = self._take_slot(self._blocks)
            if slot is None:
                break
            self._loading.add(key)
            taken.append((key, slot))
        return DiskRead(taken, waits)

    def loaded(self, results) -> int:
        """(key, slot, checksum or None) of blocks read back from disk: those read are indexed as idle blocks, the
        slots of the others (and of blocks written meanwhile by a request) freed; how many were indexed."""
        n = 0
        for key, slot, checksum in results:
            self._loading.discard(key)
            if checksum is None or key in self._by_key:
                self._blocks.free.append(slot)
                continue
            block = self._by_key[key] = self._by_slot[slot] = _Block(key, slot, True, checksum)
            self._blocks.idle[key] = block
            n += 1
        return n

    def release(self, request_id: str) -> None:
        """The request holds none of its blocks any more (finished, cancelled, or its worker died): its keeps slots
        go back too."""
        self._blocks.free += self._keeps.pop(request_id, [])
        self._release_holds(request_id)

    def _release_holds(self, request_id: str) -> None:
        """The request holds none of its plan's blocks any more (reported on its prompt, or gone)."""
        for block in self._held.pop(request_id, ()):
            block.holders.discard(request_id)
            if block.holders:
                continue
            if block.ready and not block.dead:
                idle = self._pool(block).idle
                idle[block.key] = block
                idle.move_to_end(block.key)
            else:  # never written (its writer did not report it), or unusable
                self._drop(block)

    def clear(self) -> int:
        """Forget every block in shared memory that nobody holds; how many. Blocks a request is reading or writing stay
        until it is done with them. (The disk tier's files: DiskTier.clear.)"""
        dropped = 0
        for pool in {id(self._blocks): self._blocks, id(self._wide): self._wide}.values():
            while pool.idle:
                _, block = pool.idle.popitem(last=False)
                self._drop(block)
                dropped += 1
        return dropped

    def status(self) -> PrefixStatus:
        ready = [b for b in self._by_key.values() if b.ready]
        wide = sum(1 for b in ready if b.wide)
        held = sum(1 for b in self._by_slot.values() if b.holders)
        pools = [self._blocks] + ([self._wide] if self._wide is not self._blocks else [])
        return PrefixStatus(self.block_tokens, self._blocks.n, sum(p.n * p.nbytes for p in pools),
                            len(ready) - wide, sum(self._pool(b).nbytes for b in ready), held, self.queries,
                            self.hits, self.stored_blocks, self.evictions, self.refused,
                            self._wide.n if self._wide is not self._blocks else 0, wide, self.generated,
                            self.disk.status() if self.disk is not None else None)

    # --- slots --------------------------------------------------------------------------------

    def _pool(self, block: _Block) -> _Slots:
        return self._wide if block.wide else self._blocks

    def _hold(self, block: _Block, request_id: str, held: list) -> None:
        if request_id not in block.holders:
            block.holders.add(request_id)
            held.append(block)
        self._pool(block).idle.pop(block.key, None)

    def _new_block(self, key: int, request_id: str, held: list, pool: _Slots, wide: bool = False) -> int:
        """A slot for a block the request will write (held for it); -1 when every slot of its size is in use."""
        slot = self._take_slot(pool)
        if slot is None:
            return -1
        block = _Block(key, slot, wide=wide)
        self._by_key[key] = self._by_slot[slot] = block
        self._hold(block, request_id, held)
        return slot

    def _take_slot(self, pool: _Slots) -> int | None:
        if pool.free:
            return pool.free.pop()
        if not pool.idle:
            return None
        _, block = pool.idle.popitem(last=False)
        self.evictions += 1
        del self._by_key[block.key]
        del self._by_slot[block.slot]
        return block.slot

    def _drop(self, block: _Block) -> None:
        if self._by_key.get(block.key) is block:
            del self._by_key[block.key]
        if self._by_slot.get(block.slot) is block:
            del self._by_slot[block.slot]
            self._pool(block).free.append(block.slot)
