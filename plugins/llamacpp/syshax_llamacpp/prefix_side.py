"""A prompt's reuse of earlier prompts' KV: the prefix cache's blocks (prefix.py reads and writes them) or, for a
model those blocks do not carry, a whole state that checkpoints.py kept. Each reported to the daemon as Cached.

PrefixSide owns the worker's end of the prefix cache (the store attached, what this build proved about resuming
inside a chunk, the blocks of a prompt still to write) and its checkpoints. It is handed a sequence when it is
submitted (what it may start from), at its first chunk (that start, into the prompt context), when its prompt is
done (its new blocks) and when it ends (what it generated). prefix.py knows nothing of a Sequence.
"""

from __future__ import annotations

import logging

import numpy as np

from syshax_llamacpp import prefix
from syshax_llamacpp.checkpoints import Checkpoint, Checkpoints
from syshax_llamacpp.codec import StateImportError, StateShape
from syshax_llamacpp.decode_batch import DecodeBatch
from syshax_llamacpp.kernels import library_build
from syshax_llamacpp.prompt_context import PromptContext
from syshax_llamacpp.sequence import Sequence
from syshaxd.sdk.gguf.header import ModelFingerprint
from syshaxd.sdk.types import Cached, EngineSpec

# the engine's lines, under the engine's logger name (the worker's log prints it)
log = logging.getLogger("syshax_llamacpp.engine")


class PrefixSide:
    """The prefix cache's store (or the checkpoints, or neither) as one worker uses it."""

    def __init__(self, spec: EngineSpec, prompt: PromptContext, fingerprint: ModelFingerprint, *, arch: str,
                 shape: StateShape, sliding_window: bool, decodes: bool) -> None:
        self.prompt = prompt
        self.fingerprint = fingerprint  # a block's model: one of another model is never read
        self.chunk = spec.prefill_chunk_size
        self.store = None  # the daemon's prefix cache: blocks of prompt KV, shared by its workers
        if spec.prefix_store and (sliding_window or not shape.plain):
            what = ("recurrent state stands for all its tokens" if shape.recurrent else
                    "KV cells carry M-RoPE positions" if shape.cell_ext else "sliding-window layers' KV")
            log.info("no prefix cache for %s: its %s, which blocks of K and V rows do not keep", arch, what)
        elif spec.prefix_store:
            from syshaxd.sdk.kv.block_store import BlockStore

            self.store = BlockStore.attach(spec.prefix_store)
        # whole states after prompts, where the plan asks for them instead of the prefix cache's blocks
        self.checkpoints: Checkpoints | None = None
        if spec.state_checkpoints_mb and decodes and self.store is None:
            self.checkpoints = Checkpoints(spec.state_checkpoints_mb << 20)
            log.info("prefix reuse for %s from whole-state checkpoints: up to %d MiB in this worker", arch,
                     spec.state_checkpoints_mb)
        # the libraries' and CPU's hash: the prefix cache's disk tier keeps only blocks of this build
        self.build = library_build() if self.store is not None else ""
        # a prompt chunk of this many tokens or more gives the same bits wherever it starts (proved at the warm-up;
        # 0: not proved, so a hit resumes only at a multiple of the chunk; 1: any chunk)
        self.exact_resume = 0
        # what a request generates is kept in the prefix cache (its plan's keeps): the warm-up proved that a decode
        # step gives a token a prompt chunk's bits, and the daemon keeps generated tokens (cpu mode)
        self.keeps_generated = False
        # (sequence, state bytes, last logits) of the prompt whose blocks are written at the next step (deferred);
        # the prompt context holds its KV until then
        self.unkept: tuple[Sequence, np.ndarray, np.ndarray | None] | None = None
        self.counters = {"cached_tokens": 0}

    def proved(self, exact_resume: int, keeps_generated: bool) -> None:
        """What the warm-up proved (proofs.Proved)."""
        self.exact_resume, self.keeps_generated = exact_resume, keeps_generated

    def look_up(self, seq: Sequence) -> None:
        """At submit: where seq's prompt may start (its cached records checked now, so the answer's usage can say what
        is reused; those written meanwhile are checked when its prompt runs), and its hit_tokens."""
        plan, handling = seq.handling.prefix, seq.handling
        if (plan is not None and self.store is not None and plan.chunk_tokens == self.chunk
                and not handling.resume_tokens):
            # the plan's records are held for this request until it reports
            seq.found = prefix.find(self.store, self.fingerprint, plan, seq.prompt, self.prompt.n_vocab,
                                    written_only=True)
            seq.hit_tokens = sum(r.n_tokens for r in prefix.usable(seq.found, plan, len(seq.prompt),
                                                                   self.exact_resume))
        elif self.checkpoints is not None and seq.request.prompt_logprobs is None and handling.kv is None:
            # a state taken where the rest then runs in chunks that give a whole run's bits (the warm-up's proof)
            seq.checkpoint = self.checkpoints.find(seq.prompt, 1 if self.exact_resume == 1 else self.chunk)
            seq.hit_tokens = seq.checkpoint.n_tokens if seq.checkpoint is not None else 0

    def start(self, seq: Sequence) -> np.ndarray | None:
        """At seq's first chunk: its start (cached blocks or a checkpoint) into the prompt context, the rest still to
        run. The last token's logits when the whole prompt was cached."""
        if seq.n_past:
            return None
        checkpoint, seq.checkpoint = seq.checkpoint, None
        if checkpoint is not None:
            self._set_checkpoint(seq, checkpoint)
            return None
        return self._import_hits(seq) if seq.found is not None else None

    def _import_hits(self, seq: Sequence) -> np.ndarray | None:
        plan = seq.handling.prefix
        if plan is None or self.store is None:
            return None
        # the blocks go in through the prompt context's scratch buffer, where deferred blocks' state waits: those were
        # written at the start of this step (the Stepper's keep_deferred runs before any prompt chunk)
        assert self.unkept is None, "cached blocks imported over a deferred prompt's state"
        found = seq.found = prefix.find(self.store, self.fingerprint, plan, seq.prompt, self.prompt.n_vocab, seq.found)
        seq.hit_tokens = 0
        blocks = prefix.usable(found, plan, len(seq.prompt), self.exact_resume)
        if not blocks:
            return None
        try:
            n = prefix.import_blocks(self.prompt.ctx, 0, blocks, self.fingerprint, self.prompt.scratch)
        except StateImportError as exc:
            self.prompt.clear()
            log.error("%s: cached prompt blocks could not be imported (%s); evaluating the whole prompt",
                      seq.request_id, exc)
            return None
        self._skip(seq, n)
        return found.whole[1] if found.whole is not None else None

    def _set_checkpoint(self, seq: Sequence, checkpoint: Checkpoint) -> None:
        if not self.prompt.set_state(checkpoint.state):
            log.error("%s: a checkpoint of %d tokens could not be set into the prompt context; evaluating the whole "
                      "prompt", seq.request_id, checkpoint.n_tokens)
            seq.hit_tokens = 0
            return
        self._skip(seq, checkpoint.n_tokens)

    def _skip(self, seq: Sequence, n: int) -> None:
        """seq's first n prompt tokens are in the prompt context already."""
        seq.hit_tokens = n
        for _ in range(n):
            seq.pending.popleft()
        seq.n_past = n
        self.counters["cached_tokens"] += n

    def keep_checkpoint(self, seq: Sequence, state: np.ndarray) -> None:
        """A later prompt starting with seq's prompt tokens starts here (state: the prompt context's, after them)."""
        if self.checkpoints is not None:
            self.checkpoints.keep(seq.prompt, state)

    def keep_blocks(self, seq: Sequence, state: np.ndarray | None, logits: np.ndarray | None) -> list:
        """Write the prompt's new blocks (and the whole prompt with its last logits) into the prefix cache as planned,
        from its state (None: the prompt context's, exported now), and tell the daemon (Cached)."""
        plan = seq.handling.prefix
        if plan is None or self.store is None:
            return []
        stored = []
        if (plan.stores or plan.final_store >= 0) and not seq.handling.resume_tokens:
            if state is None:
                state = self.prompt.export()
            stored = prefix.store_blocks(self.store, self.fingerprint, plan, state, seq.prompt,
                                         logits if plan.final_store >= 0 else None, seq.hit_tokens,
                                         self.exact_resume)
        refused = tuple(seq.found.refused) if seq.found is not None else ()
        return [Cached(seq.request_id, tuple(stored), refused, seq.hit_tokens)]

    def keep_now(self, seq: Sequence, state: np.ndarray | None, logits: np.ndarray | None) -> list:
        """keep_blocks, then the prompt context cleared."""
        cached = self.keep_blocks(seq, state, logits)
        self.prompt.clear()
        return cached

    def defers(self, seq: Sequence) -> bool:
        """Whether seq's blocks may wait for the next step: it goes on decoding, and has blocks planned."""
        return seq.next_token is not None and seq.handling.prefix is not None and self.store is not None

    def defer(self, seq: Sequence, state: np.ndarray, logits: np.ndarray | None) -> None:
        """Write seq's blocks at the next step, after its first token left: on a 2-core machine, 5 to 10 ms of writes
        into fresh pages of the store (bench/bench_ttft_prefix.py). The prompt context keeps its KV until then, and
        `state` (a view of its scratch buffer) stays unwritten."""
        self.unkept = (seq, state, logits)

    def keep_deferred(self) -> list:
        """The blocks of the prompt whose first token left last step (Cached), before anything else runs: the prompt
        context is then free, and the daemon hears of them before the request can end."""
        if self.unkept is None:
            return []
        (seq, state, logits), self.unkept = self.unkept, None
        return self.keep_now(seq, state, logits)

    def forget(self, seq: Sequence) -> None:
        """seq ends: blocks it deferred are not written (it was cancelled before the next step). The daemon let their
        slots go with the request, and may give them to another before this Cancel arrives: a step between would
        write them there, and the reader's checksum and tokens tell it so."""
        if self.unkept is not None and self.unkept[0] is seq:
            self.unkept = None
            self.prompt.clear()

    def keep_generated(self, seq: Sequence, decode: DecodeBatch) -> list:
        """Write the blocks of the finished sequence's KV after its prompt's whole blocks -- what it generated -- into
        its plan's keeps slots, and tell the daemon (Cached, before the last Delta): a chat's next turn, which sends
        the answer back, resumes after it."""
        plan = seq.handling.prefix
        if (plan is None or not plan.keeps or not self.keeps_generated or self.store is None or seq.seq_id < 0
                or not seq.fed):
            return []  # the daemon frees the keeps slots when the request ends
        history = seq.prompt + seq.fed
        if len(history) != seq.n_past:
            log.error("%s: %d tokens in the KV, %d prompt and generated; nothing generated kept",
                      seq.request_id, seq.n_past, len(history))
            return []
        kept = prefix.store_generated(self.store, self.fingerprint, plan, decode.export(seq), history,
                                      len(seq.prompt))
        return [Cached(seq.request_id, generated=tuple(kept))] if kept else []

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
