"""The warm-up: run once what serving runs, then prove what this llama.cpp build gives bit for bit.

Apart from the step because it answers another question: not "what is the next token" but "may the engine
rely on this build" -- that a prompt chunk of any size gives the bits one chunk gives (exact_resume), that a
decode step gives a token a prompt chunk's bits (exact_decode), that a lone row decodes as in a batch (pad_lone).
Serving only reads the three answers; each proof runs once per worker (EngineSpec.proven keeps them across
restarts) and says in the log what it found.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass

import llama_cpp
import numpy as np

from syshax_llamacpp import drafting
from syshax_llamacpp.codec import StateBuffer, StateFormatError, StateShape, export_seq
from syshax_llamacpp.contexts import add_row
from syshax_llamacpp.decode_batch import SPLIT_KV_FROM, DecodeBatch
from syshax_llamacpp.prompt_context import PromptContext
from syshaxd.sdk import faults
from syshaxd.sdk.gguf.quantize import ROW_EXACT_TYPES
from syshaxd.sdk.types import EngineSpec

# the engine's lines, under the engine's logger name (the worker's log prints it)
log = logging.getLogger("syshax_llamacpp.engine")

# The shortest prompt chunk whose bits llama.cpp's CPU kernels keep wherever it starts (measured on AVX-512:
# 64 and more keep them, 63 and fewer do not; bench/bench_chunk_invariance.py). Each worker proves it at its
# warm-up before a prefix cache hit relies on it.
EXACT_RESUME = 64


@dataclass(frozen=True)
class Proved:
    """What a warm-up proved of this build on this CPU; serving only reads it."""

    exact_decode: bool = False  # a decode step gives a token the bits a prompt chunk of any size gives it
    exact_resume: int = 0  # a prompt chunk of this many tokens or more gives the same bits wherever it starts
    pad_lone: bool = False  # a lone sequence past SPLIT_KV_FROM tokens needs a padding row beside it
    keeps_generated: bool = False  # what a request generates may be kept in the prefix cache
    step_cost: drafting.StepCost | None = None  # guessed rows give a lone row's bits, at these first costs
    warm_tokens: tuple[int, ...] = ()  # the warm-up prompt's tokens (the draft model's first costs)


class WarmUp:
    """One worker's warm-up and proofs, over its prompt context and (a decoder's) decode batch, which it leaves
    empty.

    tiled_attention: every query row's attention is tiled (contexts.load_model); prefix_cache: the worker has the
    prefix cache's store, so whether a prompt may resume inside a chunk matters; weight_types: what the kernels
    multiply, which a failed proof's warning names."""

    def __init__(self, spec: EngineSpec, prompt: PromptContext, decode: DecodeBatch | None, *, seq_ctx: int,
                 shape: StateShape, weight_types: tuple[str, ...], tiled_attention: bool, prefix_cache: bool,
                 speculative_tokens: int) -> None:
        self.spec, self.prompt, self.decode = spec, prompt, decode
        self.n_vocab, self.chunk, self.seq_ctx = prompt.n_vocab, prompt.chunk, seq_ctx
        self.shape, self.weight_types = shape, weight_types
        self.tiled_attention, self.prefix_cache = tiled_attention, prefix_cache
        self.speculative_tokens = speculative_tokens
        self.exact_decode, self.exact_resume = False, 0
        self.pad_lone = decode.pad_lone if decode is not None else False

    def run(self) -> Proved:
        """One full prompt chunk, a state export and import into every batch stream, and one full decode batch:
        what serving runs, so that kernels which crash on this CPU crash here, before the worker says ready.
        Then the proofs (unless an earlier warm-up of this worker kept them): with tiled attention, that a decode
        step gives a prompt chunk's bits; that a lone row decodes as in a batch; with a prefix cache and no tiled
        proof, that a prompt's bits do not depend on where its chunks start."""
        n = min(self.chunk, self.seq_ctx - 1)  # room for the decode step's token after it
        # token ids spread over the vocabulary: a prompt's rows as any text gives them
        tokens = [(7 + 31 * i) % self.n_vocab for i in range(n)]
        step_cost = None
        try:
            if self.prompt.decode(tokens, 0) != 0:
                raise RuntimeError(f"warm-up: llama_decode of a {n}-token prompt chunk failed")
            decode = self.decode
            state = self.prompt.export(room=8 * decode.max_seqs if decode is not None else 0)
            if self.spec.fault == "state":
                raise StateFormatError("fault injection (SYSHAX_FAULT=state): a state layout this codec does not know")
            reference = (state.copy(), self.prompt.logits(n - 1).copy())
            rewound = None  # a recurrent state cannot drop its last token: _proves_lone sets the prompt's again
            if decode is not None:
                widened = self.prompt.widen(state, decode.max_seqs, self.shape)
                rewound = widened.copy() if self.shape.recurrent else None
                decode.batch.n_tokens = 0
                for stream in range(decode.max_seqs):
                    got = llama_cpp.llama_state_seq_set_data(decode.ctx, StateBuffer.pointer(widened), widened.nbytes,
                                                             stream)
                    if got != widened.nbytes:
                        raise RuntimeError(f"warm-up: the prompt's state did not import into stream {stream}")
                    add_row(decode.batch, tokens[stream % n], n, stream, True)
                if llama_cpp.llama_decode(decode.ctx, decode.batch) != 0:
                    raise RuntimeError(f"warm-up: llama_decode of a {decode.max_seqs}-row decode batch failed")
            proven = self.spec.proven  # an earlier warm-up of this worker proved these on this CPU and build
            if proven is not None:
                self.exact_decode, self.exact_resume, self.pad_lone = (
                    proven.exact_decode, proven.exact_resume, proven.pad_lone and self.pad_lone)
                log.info("proofs kept from this worker's earlier warm-up: %s", self._proved_words())
            else:
                if self.tiled_attention:
                    self.exact_decode = (self._proves_decode_kv(decode, tokens + [tokens[0]]) if decode is not None
                                         else self._proves_any_chunking(tokens, *reference))
                if self.pad_lone and decode is not None:
                    self.pad_lone = not self._proves_lone(decode, tokens[0], n, rewound)
                if self.exact_decode:
                    self.exact_resume = 1  # a chunk of any size gives the bits, wherever it starts
                elif self.prefix_cache:
                    self.exact_resume = self._prove_chunking(tokens, *reference)
            if self.speculative_tokens and decode is not None:
                step_cost = self._proves_guessed_rows(decode, tokens, n) if self.exact_decode else None
                if not self.exact_decode:
                    log.info("speculative decoding off: this build's decode rows may not give a prompt chunk's bits")
        finally:
            self.prompt.clear()
            if self.decode is not None:
                self.decode.clear()
        keeps = self.exact_decode and self.decode is not None and self.spec.keep_generated and self.prefix_cache
        return Proved(self.exact_decode, self.exact_resume, self.pad_lone, keeps, step_cost, tuple(tokens))

    def _suspects(self, attention: str = "") -> str:
        """What can make a row's bits depend on its neighbours or its chunk, in words for the warning: this model's
        weight types where any is not one the patch series proves (ROW_EXACT_TYPES), else the build."""
        unproven = [t for t in self.weight_types if t not in ROW_EXACT_TYPES]
        build = attention or "a llama.cpp not built by mk/llama-wheel.sh"
        if unproven:
            return (f"this model's {', '.join(unproven)} weights, whose llama.cpp kernels sum a row by how many rows "
                    f"share it; or {build}")
        return f"{build}? this model's weights ({', '.join(self.weight_types) or 'unknown'}) are of types it proves"

    def _proved_words(self) -> str:
        return (f"decode steps {'give' if self.exact_decode else 'may not give'} a prompt chunk's bits, prefix hits "
                f"resume inside chunks of {self.exact_resume or 'whole'} tokens or more, a lone sequence "
                f"{'decodes beside a padding row' if self.pad_lone else 'needs no padding row'}")

    def _proves_decode_kv(self, decode: DecodeBatch, history: list[int]) -> bool:
        """Whether stream 0 of the decode batch just run -- its prompt from one chunk, its last token from the
        decode step -- holds the very KV bytes, and its row the very logits, that the prompt context gives the
        same tokens in chunks of 1, 16 and the rest: true where every query row's attention is tiled
        (contexts.TILED_ATTENTION_ENV with mk/llama-wheel.sh's llama.cpp), so a decoded token's KV can be kept as if
        a prompt had computed it. Leaves the prompt context empty."""
        n = len(history)
        batched = decode.logits(0).copy()
        decoded = export_seq(decode.ctx, 0, decode.scratch).copy()  # every KV cache of the model's (gemma: two)
        cuts = [0, 1]  # a row alone, then 16 rows, then chunks as long as they come
        while cuts[-1] < n:
            cuts.append(min(n, cuts[-1] + (min(16, self.chunk) if len(cuts) == 2 else self.chunk)))
        self.prompt.clear()
        try:
            logits = self._run_cuts(history, cuts)
            # the prompt's state, addressed as the batch context's stream 0: the same bytes where every K and V
            # (and every position) is the same
            widened = self.prompt.widen(self.prompt.export(room=8 * decode.max_seqs), decode.max_seqs, self.shape)
            same = np.array_equal(logits, batched) and np.array_equal(widened, decoded)
        finally:
            self.prompt.clear()
        if faults.fails_proof(self.spec.fault, "generated"):
            same = False
        if same:
            sizes = ", ".join(str(e - s) for s, e in zip(cuts, cuts[1:]))
            log.info("a decode step and prompt chunks of %s tokens give the same bits: a resumed request gets the "
                     "undisturbed run's tokens%s", sizes,
                     "" if not self.prefix_cache else ", prefix hits resume after any block" +
                     (", and what a request generates is kept" if self.spec.keep_generated else ""))
        else:
            log.warning("a decode step gives other bits than a prompt chunk here (%s): nothing generated is kept, and "
                        "a resumed request may part from its undisturbed text at a near-tie", self._suspects())
        return same

    def _proves_any_chunking(self, tokens: list[int], state: np.ndarray, logits: np.ndarray) -> bool:
        """A prefill-only worker's _proves_decode_kv (it has no decode batch): whether the warm-up prompt, run again in
        chunks of 1, 16 and the rest, gives the very KV bytes and last logits it gave in one chunk -- true with every
        query row's attention tiled, so that its records are what a decoder's own prompt pass would give."""
        n = len(tokens)
        cuts = [c for c in (0, 1, min(17, n)) if c < n] + [n]
        try:
            last = self._run_cuts(tokens, cuts)
            same = np.array_equal(self.prompt.export(), state) and np.array_equal(last, logits)
        finally:
            self.prompt.clear()
        if faults.fails_proof(self.spec.fault, "generated"):
            same = False
        sizes = ", ".join(str(e - s) for s, e in zip(cuts, cuts[1:]))
        if same:
            log.info("prompt chunks of %s tokens give the bits of one chunk: this worker's KV is a decoder's own", sizes)
        else:
            log.warning("prompt chunks of %s tokens give other bits than one chunk here (%s): its decoders' tokens "
                        "may part from cpu mode's at a near-tie", sizes, self._suspects())
        return same

    def _proves_lone(self, decode: DecodeBatch, token: int, n: int, rewound: np.ndarray | None = None) -> bool:
        """Whether a row decoded alone gets the bits the same row got in the full batch just decoded (stream 0's,
        `token` at position n after n cells): true with a llama.cpp that never splits a lone row's attention among
        its threads (mk/llama-wheel.sh's build), false with a stock one. Only a KV past SPLIT_KV_FROM cells can
        tell the two apart; with a shorter warm-up prompt it is not proved, and a lone sequence keeps its padding
        row. `rewound`: the prompt's state as stream 0 took it, set again where a recurrent state cannot drop the
        decoded token."""
        if n + 1 <= SPLIT_KV_FROM:
            log.info("a lone sequence decodes beside a padding row (a %d-token warm-up cannot prove it need not)", n)
            return False
        batched = decode.logits(0).copy()
        for stream in range(1, decode.max_seqs):
            llama_cpp.llama_memory_seq_rm(decode.memory, stream, -1, -1)
        if rewound is None:
            llama_cpp.llama_memory_seq_rm(decode.memory, 0, n, -1)
        elif (llama_cpp.llama_state_seq_set_data(decode.ctx, StateBuffer.pointer(rewound), rewound.nbytes, 0)
              != rewound.nbytes):
            raise RuntimeError("warm-up: the prompt's state did not import into stream 0 again")
        decode.batch.n_tokens = 0
        add_row(decode.batch, token, n, 0, True)
        if llama_cpp.llama_decode(decode.ctx, decode.batch) != 0:
            raise RuntimeError("warm-up: llama_decode of a lone row failed")
        alone = decode.logits(0)
        same = np.array_equal(alone, batched) and not faults.fails_proof(self.spec.fault, "lone")
        if same:
            log.info("a lone sequence past %d tokens gets the bits it gets in a batch: it decodes without a padding "
                     "row", SPLIT_KV_FROM)
        else:
            log.warning("a lone row gets other bits than in a batch here (%s): a lone sequence past %d tokens "
                        "decodes beside a padding row, 1 to 2 ms a step, so that its text is the one it gets beside "
                        "others", self._suspects(attention="a llama.cpp that splits a lone row's attention among "
                                                           "its threads"), SPLIT_KV_FROM)
        return same

    def _proves_guessed_rows(self, decode: DecodeBatch, tokens: list[int], n: int) -> drafting.StepCost | None:
        """Speculative decoding's proof and first costs: whether a sequence's 1 + speculative_tokens rows in one
        decode step of the batch context get the very logits each gets in a step of its own (stream 0, after a
        prompt of the warm-up's tokens), and what a step of each row count costs (one row: the median of its
        1 + speculative_tokens steps): a guess is then token-exact here, and drafting.best_guess has first costs.
        None (speculation off) where the bits differ. Leaves the batch context's streams empty after the prompt's
        cells."""
        rows = 1 + self.speculative_tokens
        prompt = min(n, self.seq_ctx - rows)
        if prompt < 1:
            log.info("speculative decoding off: %d KV cells leave no room to check %d rows", self.seq_ctx, rows)
            return None
        for stream in range(1, decode.max_seqs):
            llama_cpp.llama_memory_seq_rm(decode.memory, stream, -1, -1)
        guess = [tokens[(5 * j + 3) % n] for j in range(rows)]
        b = decode.batch

        def run_rows(first: int, count: int) -> float:
            b.n_tokens = 0
            for j in range(first, first + count):
                add_row(b, guess[j], prompt + j, 0, True)
            started = time.perf_counter()
            if llama_cpp.llama_decode(decode.ctx, b) != 0:
                raise RuntimeError(f"warm-up: llama_decode of {count} rows of one sequence failed")
            return time.perf_counter() - started

        def logits(i: int) -> np.ndarray:
            return decode.logits(i).copy()

        llama_cpp.llama_memory_seq_rm(decode.memory, 0, prompt, -1)
        one_row, alone = [], []
        for j in range(rows):
            one_row.append(run_rows(j, 1))
            alone.append(logits(0))
        llama_cpp.llama_memory_seq_rm(decode.memory, 0, prompt, -1)
        all_rows = run_rows(0, rows)
        together = [logits(j) for j in range(rows)]
        llama_cpp.llama_memory_seq_rm(decode.memory, 0, prompt, -1)
        same = all(np.array_equal(a, t) for a, t in zip(alone, together))
        if faults.fails_proof(self.spec.fault, "guesses") or not same:
            log.warning("speculative decoding off: %d rows of a sequence in one decode step gave other bits than "
                        "each in a step of its own (%s), so a guess could change a text", rows, self._suspects())
            return None
        cost = drafting.StepCost()  # steps as serving times them correct these first points
        cost.add(1, statistics.median(one_row))
        # every count, the shorter of two tries (what else runs only adds time): the kernels take rows one at a time
        # or in groups of four, so a step's time is no line through its rows (bench_verify_rows.py --every 8 here: 8
        # rows cost less than 7), and a line drawn from 1 and 9 rows took a 3-token guess for cheaper than it is and
        # an 8-row step for dearer
        for count in range(2, rows + 1):
            tries = [all_rows] if count == rows else []
            while len(tries) < 2:
                tries.append(run_rows(0, count))
                llama_cpp.llama_memory_seq_rm(decode.memory, 0, prompt, -1)
            cost.add(count, min(tries))
        log.info("speculative decoding: up to %d guessed tokens a step, checked in rows that give a lone row's bits "
                 "(a step of 1 row %.1f ms here; of 2 to %d rows, in steps of 1 row: %s)", self.speculative_tokens,
                 1000 * cost.seconds[1], rows,
                 " ".join(f"{cost.seconds[c] / cost.seconds[1]:.2f}" for c in range(2, rows + 1)))
        return cost

    def _prove_chunking(self, tokens: list[int], state: np.ndarray, logits: np.ndarray) -> int:
        """EXACT_RESUME if the warm-up prompt, run again in chunks of that many tokens or more that start off
        every grid (16 + EXACT_RESUME, then the middle, then the last EXACT_RESUME), gives the very bytes of KV
        and last logits it gave in one chunk; else 0, and the prefix cache resumes only at whole chunks."""
        m, n = EXACT_RESUME, len(tokens)
        if n < 2 * m:
            log.info("prefix cache: a chunk of %d tokens is too short to resume inside it; hits resume at whole "
                     "chunks", self.chunk)
            return 0
        cuts = [0, m + 16, n - m, n] if n - m - (m + 16) >= m else [0, n - m, n]
        try:
            last = self._run_cuts(tokens, cuts)
            again = self.prompt.export()
            same = np.array_equal(again, state) and np.array_equal(last, logits)
        finally:
            self.prompt.clear()
        if faults.fails_proof(self.spec.fault, "chunking"):
            same = False
        sizes = ", ".join(str(e - s) for s, e in zip(cuts, cuts[1:]))
        if not same:
            log.warning("prefix cache: a %d-token prompt run in chunks of %s tokens gave other bits than in one "
                        "chunk on this CPU; hits resume only at multiples of %d tokens", n, sizes, self.chunk)
            return 0
        log.info("prefix cache: a %d-token prompt gives the same bits in chunks of %s tokens as in one; hits resume "
                 "after any block where %d tokens or more are left to the chunk's end", n, sizes, m)
        return m

    def _run_cuts(self, tokens: list[int], cuts: list[int]) -> np.ndarray:
        """The warm-up's proofs: tokens into the prompt context (emptied first) from position 0, in the chunks between
        consecutive cuts; a view of the last token's logits."""
        self.prompt.clear()
        for start, end in zip(cuts, cuts[1:]):
            last = "last" if end == len(tokens) else "none"
            if self.prompt.decode(tokens[start:end], start, last) != 0:
                raise RuntimeError(f"warm-up: llama_decode of a {end - start}-token prompt chunk failed")
        return self.prompt.logits(cuts[-1] - cuts[-2] - 1)
