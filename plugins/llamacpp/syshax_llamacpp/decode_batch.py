"""The decode batch: the batch context, a KV stream per slot, and one llama_decode a step for every decoding row.

It keeps the decoding sequences' streams one consecutive run (streams.py says why) by moving an end of the run into a
hole, feeds each sequence's rows in stream order (its next token, and any guessed tokens after it), and puts a
padding row beside a lone sequence where a stock llama.cpp would sum its attention otherwise (pad_stream).
"""

from __future__ import annotations

import logging
import time

import llama_cpp
import numpy as np

from syshax_llamacpp.codec import StateBuffer, export_seq
from syshax_llamacpp.contexts import add_row, free_context
from syshax_llamacpp.sequence import Sequence, SlotState
from syshax_llamacpp.streams import StreamRun

# the engine's lines, under the engine's logger name (the worker's log prints it)
log = logging.getLogger("syshax_llamacpp.engine")

# A lone decoding sequence's KV length (cells) from which a stock llama.cpp's CPU flash attention splits the KV
# among its threads (ggml-cpu/ops.cpp: use_split_kv_path, nek1 >= 512; the length is the cells padded to 256).
# mk/llama-wheel.sh builds llama.cpp without that split; the warm-up proves which kind is loaded (_proves_lone).
SPLIT_KV_FROM = 256


class DecodeBatch:
    """The batch context and what lives in it: max_seqs streams of KV, the batch of n_batch rows a step."""

    def __init__(self, model, params, max_seqs: int, n_batch: int, n_vocab: int) -> None:
        self.ctx = llama_cpp.llama_init_from_model(model, params)
        if self.ctx is None:
            raise RuntimeError("llama.cpp could not create the batch context (out of memory?)")
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        self.max_seqs, self.n_batch, self.n_vocab = max_seqs, n_batch, n_vocab
        self.streams = StreamRun(max_seqs)  # a decoding sequence's KV stream: seq_id in the batch context
        self.scratch = StateBuffer()  # a sequence's state on its way from one stream to another, or out
        # a lone decoding sequence past SPLIT_KV_FROM tokens decodes beside a padding row, so that its attention sums
        # as in a batch; False once the warm-up proved this llama.cpp sums a lone row that way anyway, or where one
        # slot is all there is (a sequence is then always alone)
        self.pad_lone = max_seqs > 1
        self.counters = {"steps": 0, "padded_steps": 0, "stream_moves": 0}

    def proved(self, pad_lone: bool) -> None:
        """What the warm-up proved (proofs.Proved): whether a lone sequence needs its padding row."""
        self.pad_lone = pad_lone

    def enter(self, seq: Sequence, state: np.ndarray) -> bool:
        """seq's KV (a whole state, widened for max_seqs streams) into a stream of its own, next to the others; False,
        with no stream taken, when llama.cpp takes less than all of it."""
        stream = self.streams.take()
        got = llama_cpp.llama_state_seq_set_data(self.ctx, StateBuffer.pointer(state), state.nbytes, stream)
        if got != state.nbytes:
            self.drop(stream)
            return False
        seq.seq_id = stream
        seq.enter(SlotState.DECODING)
        return True

    def take_stream(self) -> int:
        """A stream for a KV record to be read into (handoff.Handoff.take_kv); given back with drop() if it fails."""
        return self.streams.take()

    def drop(self, stream: int) -> None:
        """Empty a stream and give it back: a hole, if it was inside the run, that the next step's compact fills."""
        llama_cpp.llama_memory_seq_rm(self.memory, stream, -1, -1)
        self.streams.give_back(stream)

    def leave(self, seq: Sequence) -> None:
        """seq is done: its stream emptied and given back."""
        if seq.seq_id >= 0:
            self.drop(seq.seq_id)
            seq.seq_id = -1

    def export(self, seq: Sequence) -> np.ndarray:
        """seq's state (a view of the scratch buffer, good until the next export or move)."""
        return export_seq(self.ctx, seq.seq_id, self.scratch)

    def drop_after(self, seq: Sequence) -> None:
        """Drop seq's KV past its n_past tokens (guessed rows the sampler refused)."""
        llama_cpp.llama_memory_seq_rm(self.memory, seq.seq_id, seq.n_past, -1)

    def logits(self, i: int) -> np.ndarray:
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, i), (self.n_vocab,))

    def compact(self, active) -> None:
        """Fill each hole in the run of decoding streams with the end of the run that holds fewer tokens."""
        while holes := self.streams.holes():
            by_stream = {s.seq_id: s for s in active if s.seq_id >= 0}
            lo, hi = self.streams.ends()
            if not self._move(min(by_stream[lo], by_stream[hi], key=lambda s: s.n_past), holes[0]):
                break

    def _move(self, seq: Sequence, target: int) -> bool:
        """Move seq's KV into stream `target`: the same bytes, so the same next tokens."""
        size = llama_cpp.llama_state_seq_get_size(self.ctx, seq.seq_id)
        buf = export_seq(self.ctx, seq.seq_id, self.scratch)
        got = llama_cpp.llama_state_seq_set_data(self.ctx, StateBuffer.pointer(buf), size, target)
        if got != size:  # never seen; the sequence stays where it is, and the next step takes two ubatches
            llama_cpp.llama_memory_seq_rm(self.memory, target, -1, -1)
            log.error("could not move a sequence's KV from stream %d to %d (%d of %d bytes)", seq.seq_id, target,
                      got, size)
            return False
        llama_cpp.llama_memory_seq_rm(self.memory, seq.seq_id, -1, -1)
        self.streams.moved(seq.seq_id, target)
        seq.seq_id = target
        self.counters["stream_moves"] += 1
        return True

    def pad_stream(self, decoding: list[Sequence]) -> int:
        """A free stream next to a lone decoding sequence's, for a one-token row beside it; -1 when none is needed.

        Only with a stock llama.cpp (pad_lone: the warm-up's proof, proofs.WarmUp._proves_lone; mk/llama-wheel.sh
        builds one that never splits). With one query row in the ubatch and 512 KV cells or more (a sequence past 256
        tokens), its CPU flash attention splits the KV among its threads and sums the parts (ops.cpp,
        use_split_kv_path); with two streams in the ubatch it walks every row's KV in order. The two sum differently,
        so a sequence decoded alone would get other bits than in a batch (bench/bench_concurrent_exactness.py): a row
        in a second stream keeps a lone sequence on the batch's path, and its text the same alone or not. The price:
        a lone step past 256 tokens takes 1 to 2 ms more (bench/bench_concurrent_exactness.py --step-cost)."""
        # the KV length llama.cpp attends over is the stream's cells padded to 256, so the split starts past 256
        # tokens; below that a padding row would only cost time (about 2 ms a step here: two rows take another
        # matmul path than one)
        if not self.pad_lone or len(decoding) != 1 or decoding[0].n_past + 1 <= SPLIT_KV_FROM:
            return -1
        stream = decoding[0].seq_id
        for pad in (stream + 1, stream - 1):
            if 0 <= pad < self.max_seqs and pad not in self.streams.busy:
                return pad
        return -1

    def feed(self, decoding: list[Sequence], guesses: list[list[int]], pad: int) -> list[tuple[Sequence, int]]:
        """Each decoding sequence's next token (fed: in its KV from now), then its guessed tokens, a row each, in
        stream order, with the padding row beside a lone one (pad >= 0); each sequence's first row."""
        rows = []
        self.batch.n_tokens = 0
        for seq, guess in zip(decoding, guesses):
            token = seq.next_token
            assert token is not None  # a decoding sequence's, sampled last step
            if 0 <= pad < seq.seq_id:
                add_row(self.batch, token, 0, pad, False)
            rows.append((seq, add_row(self.batch, token, seq.n_past, seq.seq_id, True)))
            for j, guessed in enumerate(guess):  # each guessed token's row: its logits check the next guess
                add_row(self.batch, guessed, seq.n_past + 1 + j, seq.seq_id, True)
            if pad > seq.seq_id:
                add_row(self.batch, token, 0, pad, False)
            seq.n_past += 1
            seq.fed.append(token)
            seq.next_token = None
        return rows

    def decode(self, pad: int) -> tuple[int, int, float]:
        """One llama_decode of the rows fed; its return code (0: done), its rows and its seconds. The padding row's KV
        is dropped."""
        started = time.perf_counter()
        rc = llama_cpp.llama_decode(self.ctx, self.batch)
        seconds = time.perf_counter() - started
        if pad >= 0:
            llama_cpp.llama_memory_seq_rm(self.memory, pad, -1, -1)
            self.counters["padded_steps"] += 1
        self.counters["steps"] += 1
        return rc, self.batch.n_tokens, seconds

    def clear(self) -> None:
        """Every stream emptied (the warm-up's end)."""
        for stream in range(self.max_seqs):
            llama_cpp.llama_memory_seq_rm(self.memory, stream, -1, -1)

    def close(self) -> None:
        free_context(self.ctx, self.batch)
        self.ctx = self.batch = None
