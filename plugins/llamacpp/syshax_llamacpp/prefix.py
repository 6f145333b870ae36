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


def import_blocks(ctx, seq_id: int, blocks: list[KVRecord], fingerprint: ModelFingerprint,
                  scratch: StateBuffer) -> int:
    """Load the blocks into seq_id of ctx as its first tokens; returns how many. Raises StateImportError."""
    chain = BlockChain(fingerprint, tuple(blocks))
    import_record(ctx, seq_id, chain, v_trans=False, scratch=scratch)
    return chain.n_tokens


def store_blocks(store: BlockStore, fingerprint: ModelFingerprint, plan: PrefixPlan, state_bytes,
                 prompt: list[int]) -> list[tuple[int, int]]:
    """Write the planned blocks of a prompt whose KV the state holds; (slot, checksum) of each written."""
    state = parse_seq_state(state_bytes, fingerprint)
    c = plan.block_tokens
    order = np.argsort(state.positions, kind="stable")  # cells are in position order, but need not be
    if not np.array_equal(state.positions[order], np.arange(state.n_tokens)):
        log.warning("prefix cache: the prompt's KV is not positions 0..%d; nothing kept", state.n_tokens - 1)
        return []
    stored = []
    for index, slot in plan.stores:
        start, end = index * c, (index + 1) * c
        if end > state.n_tokens:
            break
        rows = order[start:end]
        block: SeqState = replace(state, positions=state.positions[rows], k=[k[rows] for k in state.k],
                                  v=[v[rows] for v in state.v])
        view = store.slot(slot)
        try:
            encode_state_into(view, fingerprint, block, prompt[start:end])
        except ValueError as exc:  # a KV cache type wider than the store was sized for
            log.warning("prefix cache: block %d does not fit its slot (%s); not kept", index, exc)
            break
        stored.append((slot, decode(view, verify=False).checksum))
    return stored
