"""This engine's end of the prefix cache: check and import a prompt's cached blocks, write its new ones.

The daemon plans which slots of the block store hold the prompt's first blocks and which it may fill
(engine/prefix_cache.py); each slot holds one block as a neutral KV record. Nothing here trusts the
plan: a block is used only when its record's checksum is the one reported when it was written and
its token ids and positions are exactly those of the prompt at that place.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import numpy as np

from syshax_llamacpp.codec import SeqState, StateBuffer, encode_state_into, import_record, parse_seq_state
from syshaxd.sdk.types import PrefixPlan
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
    """
    found = found if found is not None else Found()
    c = plan.block_tokens
    if found.refused or found.whole is not None:
        return found  # a refusal ends the run; a whole prompt is all there is
    for j in range(len(found.blocks), len(plan.hits)):
        slot, checksum = plan.hits[j]
        if written_only and not checksum:
            return found
        record, why, _ = _read(store, slot, 0, fingerprint, checksum, prompt, j * c, (j + 1) * c)
        if why:
            return _refuse(found, slot, checksum, f"block {j}", why)
        found.blocks.append(record)
    if plan.final is None or len(found.blocks) != (len(prompt) - 1) // c:
        return found
    slot, checksum = plan.final
    if written_only and not checksum:
        return found
    record, why, view = _read(store, slot, 4 * n_vocab, fingerprint, checksum, prompt, len(found.blocks) * c,
                              len(prompt))
    if why:
        return _refuse(found, slot, checksum, "the whole prompt", why)
    # written before the record's seal, so a record that checks out has its logits
    found.whole = (record, np.frombuffer(view, np.float32, n_vocab, len(view) - 4 * n_vocab).copy())
    return found


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
                 prompt: list[int], logits: np.ndarray | None) -> list[tuple[int, int]]:
    """Write the planned blocks of a prompt whose KV the state holds, and the whole prompt's last chunk with
    its last token's logits when planned; (slot, checksum) of each written."""
    state = parse_seq_state(state_bytes, fingerprint)
    c = plan.block_tokens
    order = np.argsort(state.positions, kind="stable")  # cells are in position order, but need not be
    if not np.array_equal(state.positions[order], np.arange(state.n_tokens)) or state.n_tokens != len(prompt):
        log.warning("prefix cache: the prompt's KV is not positions 0..%d; nothing kept", len(prompt) - 1)
        return []
    spans = [(slot, index * c, (index + 1) * c) for index, slot in plan.stores]
    if plan.final_store >= 0 and logits is not None:
        spans.append((plan.final_store, (len(prompt) - 1) // c * c, len(prompt)))
    stored = []
    for slot, start, end in spans:
        rows = order[start:end]
        block: SeqState = replace(state, positions=state.positions[rows], k=[k[rows] for k in state.k],
                                  v=[v[rows] for v in state.v])
        view = store.slot(slot)
        logits_at = len(view) - 4 * len(logits) if logits is not None else len(view)
        try:
            if slot == plan.final_store:  # the logits first: a reader trusts them once the record checks out
                np.frombuffer(view, np.float32, len(logits), logits_at)[:] = logits
            encode_state_into(view[:logits_at], fingerprint, block, prompt[start:end])
        except ValueError as exc:  # a KV cache type wider than the store was sized for
            log.warning("prefix cache: tokens %d..%d do not fit their slot (%s); not kept", start, end - 1, exc)
            break
        stored.append((slot, decode(view, verify=False).checksum))
    return stored
