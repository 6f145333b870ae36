"""The prefix cache as the engine uses it for one sequence: its hits into the prompt context when its prompt
starts, its new blocks into the store when its prompt is done, what it generated when it ends; each reported to
the daemon as Cached.

Apart from prefix.py, which checks, reads and writes the blocks and knows nothing of the engine (a Sequence
holds a prefix.Found, so prefix.py must not know a Sequence).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import llama_cpp
import numpy as np

from syshax_llamacpp.codec import StateBuffer, StateImportError, export_seq
from syshax_llamacpp import prefix
from syshaxd.sdk.types import Cached

if TYPE_CHECKING:
    from syshax_llamacpp.sequence import Sequence

# the engine's lines, under the engine's logger name (the worker's log prints it)
log = logging.getLogger("syshax_llamacpp.engine")


class PrefixSide:
    """The LlamaCppEngine's use of prefix.py: a prompt's hits into the prompt context when it starts,
    its new blocks (and at its end what it generated) into the store, each reported to the daemon as Cached."""

    def _import_hits(self, seq: Sequence) -> np.ndarray | None:
        """Start seq's prompt from its cached blocks: their KV into the prompt context, the rest still to run.
        Returns the last token's logits when the whole prompt was cached."""
        seq.cached = False
        found = seq.found = prefix.find(self.store, self.fingerprint, seq.handling.prefix, seq.prompt, self.n_vocab,
                                        seq.found)
        seq.hit_tokens = 0
        blocks = prefix.usable(found, seq.handling.prefix, len(seq.prompt), self.exact_resume)
        if not blocks:
            return None
        try:
            n = prefix.import_blocks(self.prefill_ctx, 0, blocks, self.fingerprint, self._state)
        except StateImportError as exc:
            llama_cpp.llama_memory_seq_rm(self.prefill_memory, 0, -1, -1)
            log.error("%s: cached prompt blocks could not be imported (%s); evaluating the whole prompt",
                      seq.request.request_id, exc)
            return None
        seq.hit_tokens = n
        for _ in range(n):
            seq.pending.popleft()
        seq.n_past = n
        self.counters["cached_tokens"] += n
        return found.whole[1] if found.whole is not None else None

    def _import_checkpoint(self, seq: Sequence) -> None:
        """Start seq's prompt from the whole state found for it at submit (checkpoints.py): set into the prompt
        context, the rest still to run."""
        checkpoint, seq.checkpoint = seq.checkpoint, None
        state = checkpoint.state
        got = llama_cpp.llama_state_seq_set_data(self.prefill_ctx, StateBuffer.pointer(state), state.nbytes, 0)
        if got != state.nbytes:
            llama_cpp.llama_memory_seq_rm(self.prefill_memory, 0, -1, -1)
            log.error("%s: a checkpoint of %d tokens could not be set into the prompt context; evaluating the whole "
                      "prompt", seq.request.request_id, checkpoint.n_tokens)
            seq.hit_tokens = 0
            return
        for _ in range(checkpoint.n_tokens):
            seq.pending.popleft()
        seq.n_past = checkpoint.n_tokens
        self.counters["cached_tokens"] += checkpoint.n_tokens

    def _keep_blocks(self, seq: Sequence, state_bytes, logits) -> list:
        """Write the prompt's new blocks (and the whole prompt with its last logits) into the prefix cache as
        planned, and tell the daemon (Cached)."""
        plan = seq.handling.prefix
        if plan is None or self.store is None:
            return []
        stored = []
        if (plan.stores or plan.final_store >= 0) and not seq.handling.resume_tokens:
            if state_bytes is None:
                state_bytes = export_seq(self.prefill_ctx, 0, self._state)
            stored = prefix.store_blocks(self.store, self.fingerprint, plan, state_bytes, seq.prompt,
                                         logits if plan.final_store >= 0 else None, seq.hit_tokens,
                                         self.exact_resume)
        refused = tuple(seq.found.refused) if seq.found is not None else ()
        return [Cached(seq.request.request_id, tuple(stored), refused, seq.hit_tokens)]

    def _keep_generated(self, seq: Sequence) -> list:
        """Write the blocks of the finished sequence's KV after its prompt's whole blocks -- what it generated --
        into its plan's keeps slots, and tell the daemon (Cached, before the last Delta): a chat's next turn,
        which sends the answer back, resumes after it."""
        plan = seq.handling.prefix
        if plan is None or not plan.keeps or not self.keeps_generated or seq.seq_id < 0 or not seq.fed:
            return []  # the daemon frees the keeps slots when the request ends
        history = seq.prompt + seq.fed
        if len(history) != seq.n_past:
            log.error("%s: %d tokens in the KV, %d prompt and generated; nothing generated kept",
                      seq.request.request_id, seq.n_past, len(history))
            return []
        kept = prefix.store_generated(self.store, self.fingerprint, plan, export_seq(self.ctx, seq.seq_id, self._state),
                                      history, len(seq.prompt))
        return [Cached(seq.request.request_id, generated=tuple(kept))] if kept else []
