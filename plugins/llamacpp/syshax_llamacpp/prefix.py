"""This engine's end of the prefix cache: check and import a prompt's cached blocks, write its new ones.

The daemon plans which slots of the block store hold the prompt's first blocks and which it may fill
(engine/prefix_cache.py); each slot holds one block as a neutral KV record. Nothing here trusts the
plan: a block is used only when its record's checksum is the one reported when it was written and
its token ids and positions are exactly those of the prompt at that place.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import numpy as np

from syshax_llamacpp.codec import SeqState, StateBuffer, encode_state_into, import_record, parse_seq_state
from syshaxd.engine.types import PrefixPlan
from syshaxd.kv.block_store import BlockStore
from syshaxd.kv.record import DType, KVRecord, ModelFingerprint, RecordError, decode

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


def check_hits(store: BlockStore, fingerprint: ModelFingerprint, plan: PrefixPlan, prompt: list[int],
               written_only: bool = False) -> tuple[list[KVRecord], list[int]]:
    """The plan's hit blocks that are exactly the prompt's, in order up to the first that is not; and the
    slots of written blocks that are not (the daemon drops them).

    A block planned while it was being written (checksum 0) counts when it is complete by now; one that
    is not yet stops the run quietly. written_only: stop at the first such block.
    """
    c = plan.block_tokens
    good, refused = [], []
    for j, (slot, checksum) in enumerate(plan.hits):
        if written_only and not checksum:
            break
        start = j * c
        try:
            record = decode(store.slot(slot), expect=fingerprint)
            why = ("its checksum is not the one reported" if checksum and record.checksum != checksum
                   else "it holds other tokens" if record.tokens.tolist() != prompt[start:start + c]
                   else "its positions are not the prompt's" if not np.array_equal(record.positions,
                                                                                    np.arange(start, start + c))
                   else "")
        except (RecordError, IndexError) as exc:
            why = str(exc)
        if why and not checksum:
            break  # not written yet (or given up): the prompt runs from here
        if why:
            log.error("prefix cache: block %d (slot %d) cannot be used: %s; evaluating from token %d", j, slot, why,
                      start)
            refused.append(slot)
            break
        good.append(record)
    return good, refused


def check_final(store: BlockStore, fingerprint: ModelFingerprint, plan: PrefixPlan, prompt: list[int],
                n_vocab: int) -> tuple[tuple[KVRecord, np.ndarray] | None, list[int]]:
    """The cached last chunk of this very prompt and its last token's logits, if they are exactly this prompt's;
    and the slot, if it was written and is not (the daemon drops it)."""
    slot, checksum = plan.final
    start = (len(prompt) - 1) // plan.block_tokens * plan.block_tokens
    try:
        view = store.slot(slot)
        logits_at = len(view) - 4 * n_vocab
        record = decode(view[:logits_at], expect=fingerprint)
        why = ("its checksum is not the one reported" if checksum and record.checksum != checksum
               else "it holds other tokens" if record.tokens.tolist() != prompt[start:]
               else "its positions are not the prompt's" if not np.array_equal(record.positions,
                                                                                np.arange(start, len(prompt)))
               else "")
    except (RecordError, IndexError, ValueError) as exc:
        why = str(exc)
    if why:
        if checksum:
            log.error("prefix cache: the cached whole prompt (slot %d) cannot be used: %s", slot, why)
        return None, [slot] if checksum else []
    # written before the record's seal, so a record that checks out has its logits
    return (record, np.frombuffer(view, np.float32, n_vocab, logits_at).copy()), []


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
