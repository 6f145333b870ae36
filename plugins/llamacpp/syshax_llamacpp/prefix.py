"""This engine's end of the prefix cache: check and import a prompt's cached blocks, write its new ones.

The daemon plans which slots of the block store hold the prompt's first blocks and which it may fill
(engine/prefix_cache.py); each slot holds one block as a neutral KV record. Nothing here trusts the
plan: a block is used only when its record's checksum is the one reported when it was written and
its token ids and positions are exactly those of the prompt at that place.

A hit must give the tokens a miss gives. A miss runs its prompt in chunks on the grid of the chunk
size (0, 256, 512, ...); a hit resumes after its cached blocks with a first chunk up to the next grid
point, then runs the miss's chunks. llama.cpp's CPU kernels give a token the same bits in any chunk
of `exact_resume` tokens or more, wherever it starts (64 on the CPUs measured,
bench/bench_chunk_invariance.py); a shorter chunk gives other bits, because llama.cpp takes the
attention of chunks of 64 or more in tiles and of shorter ones a row at a time. With every row's
attention tiled (mk/llama-wheel.sh's llama.cpp, SYSHAX_FA_TILED) every chunk, and every decode
step, gives a token the same bits (exact_resume 1, bench/bench_decode_kv.py), so what a request
generated is kept too (`store_generated`). The engine proves which holds at its warm-up
(exact_resume 0 where neither does). So:

* a hit resumes after n blocks only where the first chunk it then runs starts on the grid (the miss's
  own chunk) or holds exact_resume tokens or more (`resumable`);
* a run keeps a block only if the chunk that computed it held exact_resume tokens or more -- with no
  proof, only a whole chunk -- so that every kept block holds the bits any exact run gives
  (`kept_until`). A whole prompt's last chunk is kept with its logits whatever its size: only this
  very prompt reads it, after the blocks before that chunk.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import numpy as np

from syshax_llamacpp.codec import SeqState, StateBuffer, encode_state_into, import_record, parse_seq_state
from syshaxd.sdk.types import PrefixPlan
from syshaxd.sdk.kv.block_keys import block_keys
from syshaxd.sdk.kv.block_store import BlockStore
from syshaxd.sdk.kv.record import DType, KVRecord, ModelFingerprint, RecordError, decode

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlockChain:
    """Blocks 0..n-1 of a prompt, read as one record (what codec.import_record takes)."""

    fingerprint: ModelFingerprint
    blocks: tuple[KVRecord, ...]

    @property
    def n_tokens(self) -> int:
        return sum(b.n_tokens for b in self.blocks)

    @property
    def dtype(self) -> DType:
        return self.blocks[0].dtype

    @property
    def positions(self) -> np.ndarray:
        return np.concatenate([b.positions for b in self.blocks])

    def k(self, layer: int) -> np.ndarray:
        return np.concatenate([b.k(layer) for b in self.blocks])

    def v(self, layer: int) -> np.ndarray:
        return np.concatenate([b.v(layer) for b in self.blocks])


@dataclass
class Found:
    """The cached records a prompt starts with, each checked: its first blocks, and perhaps its whole last chunk
    with its last token's logits; and the slots of written records that turned out not to be the prompt's."""

    blocks: list[KVRecord] = field(default_factory=list)
    whole: tuple[KVRecord, np.ndarray] | None = None
    refused: list[int] = field(default_factory=list)

    @property
    def records(self) -> list[KVRecord]:
        return self.blocks + ([self.whole[0]] if self.whole is not None else [])


def find(store: BlockStore, fingerprint: ModelFingerprint, plan: PrefixPlan, prompt: list[int], n_vocab: int,
         found: Found | None = None, written_only: bool = False) -> Found:
    """What of the plan is exactly this prompt's, checked in order up to the first record that is not.

    `found`: what an earlier look checked already (held for the request since, so not read again); this
    one goes on after it. A block planned while it was being written (checksum 0) counts when it is
    complete by now; one that is not yet ends the run quietly. written_only: end at the first such block.
    The whole prompt, when planned and its record checks out, ends the run after the blocks before its
    chunk.
    """
    found = found if found is not None else Found()
    if found.refused or found.whole is not None:
        return found  # a refusal ends the run; a whole prompt is all there is
    before = (len(prompt) - 1) // plan.chunk_tokens * plan.chunk_tokens // plan.block_tokens
    if plan.final is not None:
        if not _read_blocks(store, fingerprint, plan, prompt, found, min(before, len(plan.hits)), written_only):
            return found
        if len(found.blocks) >= before:
            slot, checksum = plan.final
            if written_only and not checksum:
                return found  # the run's own look tries it again
            start = before * plan.block_tokens
            record, why, view = _read(store, slot, 4 * n_vocab, fingerprint, checksum, prompt, start, len(prompt))
            if not why:
                # written before the record's seal, so a record that checks out has its logits
                del found.blocks[before:]
                found.whole = (record, np.frombuffer(view, np.float32, n_vocab, len(view) - 4 * n_vocab).copy())
                return found
            _refuse(found, slot, checksum, "the whole prompt", why)
            if found.refused:
                return found
    _read_blocks(store, fingerprint, plan, prompt, found, len(plan.hits), written_only)
    return found


def _read_blocks(store: BlockStore, fingerprint: ModelFingerprint, plan: PrefixPlan, prompt: list[int],
                 found: Found, upto: int, written_only: bool) -> bool:
    """Check the planned blocks after those found, up to block `upto`; False where the run ended before."""
    c = plan.block_tokens
    for j in range(len(found.blocks), upto):
        slot, checksum = plan.hits[j]
        if written_only and not checksum:
            return False
        record, why, _ = _read(store, slot, 0, fingerprint, checksum, prompt, j * c, (j + 1) * c)
        if why:
            _refuse(found, slot, checksum, f"block {j}", why)
            return False
        found.blocks.append(record)
    return True


def resumable(n_blocks: int, block: int, n_prompt: int, chunk: int, exact_resume: int) -> int:
    """How many of a prompt's first n_blocks cached blocks a run can resume after and give a miss's bits: the
    most whose first chunk then starts on the chunk grid or holds exact_resume tokens or more."""
    for n in range(n_blocks, 0, -1):
        start = n * block
        if start % chunk == 0:
            return n
        end = min((start // chunk + 1) * chunk, n_prompt)
        if exact_resume and end - start >= exact_resume:
            return n
    return 0


def kept_until(start: int, n_prompt: int, chunk: int, exact_resume: int) -> int:
    """Where the blocks a run from `start` may keep end: the prompt's end, or the start of its last chunk
    when that chunk is short (under exact_resume tokens, or under a whole chunk with no proof)."""
    last = max(start, (n_prompt - 1) // chunk * chunk)
    return n_prompt if n_prompt - last >= (exact_resume or chunk) else last


def usable(found: Found, plan: PrefixPlan, n_prompt: int, exact_resume: int) -> list[KVRecord]:
    """The found records a run takes: the whole prompt with the blocks before it, or the blocks it can resume
    after (`resumable`)."""
    if found.whole is not None:
        return found.records
    return found.blocks[:resumable(len(found.blocks), plan.block_tokens, n_prompt, plan.chunk_tokens, exact_resume)]


def _read(store: BlockStore, slot: int, tail: int, fingerprint: ModelFingerprint, checksum: int, prompt: list[int],
          start: int, end: int):
    """The record in the slot (before its last `tail` bytes), why it is not tokens start..end of the prompt as
    reported ("" when it is), and the slot's bytes."""
    try:
        view = store.slot(slot)
        record = decode(view[:len(view) - tail], expect=fingerprint)
    except (RecordError, IndexError, ValueError) as exc:
        return None, str(exc), None
    why = ("its checksum is not the one reported" if checksum and record.checksum != checksum
           else "it holds other tokens" if record.tokens.tolist() != prompt[start:end]
           else "its positions are not the prompt's" if not np.array_equal(record.positions, np.arange(start, end))
           else "")
    return record, why, view


def _refuse(found: Found, slot: int, checksum: int, what: str, why: str) -> Found:
    if checksum:  # written and reported, yet not what it should be: the daemon drops it
        log.error("prefix cache: %s (slot %d) cannot be used: %s; evaluating from there", what, slot, why)
        found.refused.append(slot)
    return found  # not written yet (or given up): the prompt runs from here


def import_blocks(ctx, seq_id: int, blocks: list[KVRecord], fingerprint: ModelFingerprint,
                  scratch: StateBuffer) -> int:
    """Load the blocks into seq_id of ctx as its first tokens; returns how many. Raises StateImportError."""
    chain = BlockChain(fingerprint, tuple(blocks))
    import_record(ctx, seq_id, chain, v_trans=False, scratch=scratch)
    return chain.n_tokens


def store_blocks(store: BlockStore, fingerprint: ModelFingerprint, plan: PrefixPlan, state_bytes,
                 prompt: list[int], logits: np.ndarray | None, start: int, exact_resume: int) -> list[tuple[int, int]]:
    """Write the planned blocks of a prompt whose KV the state holds and which its run from token `start`
    computed in chunks long enough (`kept_until`), and the whole prompt's last chunk with its last token's
    logits when planned; (slot, checksum) of each written."""
    state = parse_seq_state(state_bytes, fingerprint)
    c = plan.block_tokens
    order = np.argsort(state.positions, kind="stable")  # cells are in position order, but need not be
    if not np.array_equal(state.positions[order], np.arange(state.n_tokens)) or state.n_tokens != len(prompt):
        log.warning("prefix cache: the prompt's KV is not positions 0..%d; nothing kept", len(prompt) - 1)
        return []
    until = kept_until(start, len(prompt), plan.chunk_tokens, exact_resume)
    spans = [(slot, index * c, (index + 1) * c) for index, slot in plan.stores
             if index * c >= start and (index + 1) * c <= until]
    if plan.final_store >= 0 and logits is not None:
        spans.append((plan.final_store, (len(prompt) - 1) // plan.chunk_tokens * plan.chunk_tokens, len(prompt)))
    stored = []
    for slot, first, end in spans:
        checksum = _write(store, slot, fingerprint, state, order[first:end], prompt[first:end],
                          logits if slot == plan.final_store else None)
        if checksum is None:
            break
        stored.append((slot, checksum))
    return stored


def store_generated(store: BlockStore, fingerprint: ModelFingerprint, plan: PrefixPlan, state_bytes,
                    history: list[int], n_prompt: int) -> list[tuple[int, int, int]]:
    """Write the whole blocks of a finished sequence's KV from the block that holds its prompt's end on -- what it
    generated, computed by decode steps -- into the plan's keeps slots, in order; (slot, key, checksum) of each
    written, the key chained over `history` (the prompt and the generated tokens the KV holds)."""
    state = parse_seq_state(state_bytes, fingerprint)
    c = plan.block_tokens
    order = np.argsort(state.positions, kind="stable")
    if not np.array_equal(state.positions[order], np.arange(len(history))):
        log.warning("prefix cache: the sequence's KV is not positions 0..%d; nothing generated kept", len(history) - 1)
        return []
    first, last = n_prompt // c, len(history) // c
    keys = block_keys(history[:last * c], c)
    kept = []
    for slot, index in zip(plan.keeps, range(first, last)):
        span = slice(index * c, (index + 1) * c)
        checksum = _write(store, slot, fingerprint, state, order[span], history[span], None)
        if checksum is None:
            break
        kept.append((slot, keys[index], checksum))
    return kept


def _write(store: BlockStore, slot: int, fingerprint: ModelFingerprint, state: SeqState, rows: np.ndarray,
           tokens: list[int], logits: np.ndarray | None) -> int | None:
    """The state's rows (and the logits after them) as a record in the slot; its checksum, None where it does not
    fit."""
    block: SeqState = replace(state, positions=state.positions[rows], k=[k[rows] for k in state.k],
                              v=[v[rows] for v in state.v])
    view = store.slot(slot)
    logits_at = len(view) - 4 * len(logits) if logits is not None else len(view)
    try:
        if logits is not None:  # the logits first: a reader trusts them once the record checks out
            np.frombuffer(view, np.float32, len(logits), logits_at)[:] = logits
        encode_state_into(view[:logits_at], fingerprint, block, tokens)
    except ValueError as exc:  # a KV cache type wider than the store was sized for
        first = int(state.positions[rows[0]])
        log.warning("prefix cache: tokens %d..%d do not fit their slot (%s); not kept", first, first + len(rows) - 1,
                    exc)
        return None
    return decode(view[:logits_at], verify=False).checksum
