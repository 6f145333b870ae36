"""The llama.cpp CPU engine: one context, up to max_batch_size sequences decoded per llama_decode."""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import llama_cpp
import numpy as np

from syshaxd.sdk import faults
from syshaxd.sdk.gguf.quantize import ensure_quantized
from syshaxd.sdk.prompt_fit import fit_prompt
from syshaxd.sdk.gguf.vocab import Vocab
from syshax_llamacpp import kernels, logprobs, prefix
from syshax_llamacpp.sampling import (GrammarDeadEnd, GrammarError, accept, grammar_parses, make_sampler,
                                     sample_logits)
from syshax_llamacpp.streams import StreamRun
from syshaxd.sdk.output import SequenceOutput
from syshaxd.sdk.rate import TokenRate
from syshaxd.sdk.types import (Accepted, Cached, Delta, EngineSpec, EngineStats, Fallback, GenerateRequest,
                                  Handling, Imported, Prefilled, Proofs, Refusal, Rejected, TokenLogprob)
from syshaxd.sdk.gguf.header import fingerprint_from_gguf
from syshax_llamacpp.codec import StateBuffer, StateImportError, export_seq, widen_streams

log = logging.getLogger(__name__)

# The shortest prompt chunk whose bits llama.cpp's CPU kernels keep wherever it starts (measured on AVX-512:
# 64 and more keep them, 63 and fewer do not; bench/bench_chunk_invariance.py). Each worker proves it at its
# warm-up before a prefix cache hit relies on it.
EXACT_RESUME = 64

# What mk/llama-wheel.sh's llama.cpp reads, once per process, to take every query row's attention in tiles, a decode
# step's too, where llama.cpp tiles only prompt chunks of 64 tokens or more (EngineSpec.tiled_attention): then a
# chunk of any size, and a decode step, give a token the same bits (bench/bench_decode_kv.py), which the warm-up
# proves (_proves_decode_kv).
TILED_ATTENTION_ENV = "SYSHAX_FA_TILED"

# A lone decoding sequence's KV length (cells) from which a stock llama.cpp's CPU flash attention splits the KV
# among its threads (ggml-cpu/ops.cpp: use_split_kv_path, nek1 >= 512; the length is the cells padded to 256).
# mk/llama-wheel.sh builds llama.cpp without that split; the warm-up proves which kind is loaded (_proves_lone).
SPLIT_KV_FROM = 256


def _meta(model, key: bytes) -> str:
    """A metadata string of a loaded model ("" when it has none)."""
    buf = ctypes.create_string_buffer(128)
    n = llama_cpp.llama_model_meta_val_str(model, key, buf, len(buf))
    return buf.value.decode("utf-8", "replace") if n > 0 else ""


def _graph_observer(on_graph: Callable[[], None]):
    """llama.cpp's eval callback, asking to see only each graph's output node and calling on_graph there."""
    ggml = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    ggml.ggml_get_name.restype = ctypes.c_char_p
    ggml.ggml_get_name.argtypes = [ctypes.c_void_p]

    def observe(tensor, ask, _user_data):
        if ggml.ggml_get_name(tensor) != b"result_output":
            return False  # not wanted (ask), so never shown
        if not ask:
            on_graph()
        return True  # wanted; and, when shown, go on computing

    return llama_cpp.ggml_backend_sched_eval_callback(observe)


@dataclass(eq=False)
class _Sequence:
    """One request's life in the context: prefill (pending prompt tokens), then decode."""

    request: GenerateRequest
    prompt: list[int]
    max_tokens: int
    seq_id: int = -1
    n_past: int = 0  # tokens of this sequence already in the KV cache
    pending: deque = field(default_factory=deque)  # prompt tokens not yet evaluated
    next_token: int | None = None  # sampled, not yet fed back
    slotted: bool = False  # holds one of the max_batch_size slots (while queued, prefilling or decoding)
    sampler: object = None
    out: SequenceOutput | None = None
    started: float = 0.0
    handling: Handling = field(default_factory=Handling)  # how the daemon has it run here (KV, handoff, resume)
    cached: bool = False  # the prompt may start from blocks of the prefix cache (handling.prefix)
    found: prefix.Found | None = None  # the cached records checked when it was submitted
    hit_tokens: int = 0  # prompt tokens it took from the prefix cache
    # request.prompt_logprobs: the prompt's logprobs as its chunks run (None for its first token), sent once
    prompt_lp: list | None = None
    fed: list[int] = field(default_factory=list)  # generated tokens evaluated: in the KV after the prompt


class LlamaCppEngine:
    """Continuous batching: sequences join and leave the running batch at any step.

    A sequence enters decoding either by evaluating its prompt here (`pending` tokens,
    fed in chunks of at most prefill_chunk_size per step), or — for a later KV import —
    by having its state set into `seq_id` and `next_token` given; the decode loop does
    not care which.
    """

    def __init__(self, spec: EngineSpec, on_graph: Callable[[], None] | None = None) -> None:
        """on_graph (tests, diagnostics): called for every graph llama.cpp computes on the batch context --
        once per ubatch -- through its eval callback, which costs a Python call per graph node."""
        self.spec = spec
        flags = kernels.read_cpu_flags()
        # every row's attention tiled where asked for and cheap on this CPU (else llama.cpp's own attention: nothing
        # generated is kept and a resume is not exact); set before the first graph: llama.cpp reads it once per process
        # (a process's engines share one setting)
        self.tiled_attention = spec.tiled_attention and kernels.tiles_decode_cheaply(flags)
        if spec.tiled_attention and not self.tiled_attention:
            log.info("tiled_attention: this CPU has neither AVX-512 nor AVX2 with F16C and FMA, so a decode step's "
                     "tiled attention would cost more than it saves; llama.cpp's own attention runs, so nothing "
                     "generated is kept and a resumed request may part from its undisturbed text at a near-tie")
        os.environ[TILED_ATTENTION_ENV] = "1" if self.tiled_attention else "0"
        llama_cpp.llama_backend_init()
        path = Path(spec.model_path)
        if spec.quantize:
            path = ensure_quantized(path, spec.quantize, Path(spec.cache_dir or path.parent))
        self.model_path = path
        try:
            extra = kernels.extra_buffer_types()
        except (OSError, AttributeError) as exc:  # another llama-cpp-python layout: llama.cpp decides alone
            log.warning("could not list llama.cpp's CPU buffer types (%s)", exc)
            extra = None
        self.kernels = kernels.choose(spec.repack, extra, flags)
        log.info("CPU kernels: %s (%s)", self.kernels.kernels, self.kernels.why)
        mparams = llama_cpp.llama_model_default_params()
        mparams.use_extra_bufts = self.kernels.use_extra_bufts
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
        if self.model is None:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.arch = _meta(self.model, b"general.architecture") or "this model"
        if llama_cpp.llama_model_is_recurrent(self.model) or llama_cpp.llama_model_is_hybrid(self.model):
            raise RuntimeError(f"{path.name} is a {self.arch} model, whose recurrent state this engine cannot move "
                               "between its contexts; serve a transformer model (llama, qwen, mistral, gemma, phi)")
        # sliding-window layers (gemma 2 and 3): llama.cpp keeps them in a second KV cache (iswa), which the KV
        # record (ring handoffs, the prefix cache, remote nodes) does not carry; such a model serves in cpu mode,
        # each prompt computed whole
        self.sliding_window = llama_cpp.llama_model_n_swa(self.model) > 0
        if self.sliding_window and spec.ring:
            raise RuntimeError(f"{self.arch} has sliding-window attention layers, whose KV the handoff does not "
                               "carry yet: serve it in cpu mode (--mode cpu)")
        self.vocab = Vocab(model=self.model)  # tokenizing, chat template and pieces, as every engine does them
        self.n_vocab = self.vocab.n_vocab
        self.n_ctx_train = llama_cpp.llama_model_n_ctx_train(self.model)

        self.max_seqs = spec.max_batch_size
        self.chunk = spec.prefill_chunk_size
        # the batch context only ever decodes one token per sequence
        self.n_batch = self.max_seqs
        self.seq_ctx = min(spec.n_ctx, self.n_ctx_train)
        cparams = self.batch_params(self.n_batch)
        if on_graph is not None:
            self._eval_callback = _graph_observer(on_graph)  # kept: llama.cpp holds only the pointer
            cparams.cb_eval = self._eval_callback
        # a prefill-only worker hands every prompt on and never decodes: no batch context
        self.decodes = spec.role != "prefill"
        self.ctx = llama_cpp.llama_init_from_model(self.model, cparams) if self.decodes else None
        # Prompts run in a 1-sequence context of their own, one chunk per step, exactly as if the
        # request were alone; the finished KV then moves into the sequence's stream of the batch
        # context -- the same import a KV record from another engine takes in hetero mode. Mixed
        # into the batch, a prompt would make llama.cpp split it into one ubatch per stream.
        pparams = llama_cpp.llama_context_default_params()
        pparams.n_ctx = self.seq_ctx
        pparams.n_batch = pparams.n_ubatch = self.chunk
        pparams.n_seq_max = 1
        pparams.n_threads = pparams.n_threads_batch = spec.threads
        pparams.flash_attn_type = cparams.flash_attn_type
        pparams.no_perf = True
        self.prefill_ctx = llama_cpp.llama_init_from_model(self.model, pparams)
        if (self.decodes and self.ctx is None) or self.prefill_ctx is None:
            raise RuntimeError("llama.cpp could not create a context (out of memory?)")
        self.prefill_memory = llama_cpp.llama_get_memory(self.prefill_ctx)
        self.prefill_batch = llama_cpp.llama_batch_init(self.chunk, 0, 1)
        self._state = StateBuffer()
        self.n_ctx = self.seq_ctx  # the most tokens one sequence may hold (prompt + completion)
        self.memory = llama_cpp.llama_get_memory(self.ctx) if self.decodes else None
        self.batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self.port = None
        if spec.ring:
            from syshax_llamacpp.handoff import KVPort

            self.port = KVPort(spec.ring, str(path), n_stream=self.max_seqs, timeout=spec.handoff_timeout)
        # a prompt chunk of this many tokens or more gives the same bits wherever it starts (proved at the
        # warm-up; 0: not proved, so a prefix cache hit resumes only at a multiple of the chunk; 1: any chunk)
        self.exact_resume = 0
        # proved at the warm-up that a decode step gives a token the bits a prompt chunk of any size gives it
        # (_proves_decode_kv; a prefill-only worker: that chunks of any size do, _proves_any_chunking): a resume, a
        # handoff from another such worker and a prefix hit then give the undisturbed run's tokens
        self.exact_decode = False
        # what a request generates is kept in the prefix cache (its plan's keeps): exact_decode, where the daemon
        # keeps generated tokens (cpu mode)
        self.keeps_generated = False
        # a lone decoding sequence past SPLIT_KV_FROM tokens decodes beside a padding row, so that its attention
        # sums as in a batch; False once the warm-up proved this llama.cpp sums a lone row that way anyway, and
        # where nothing decodes or one slot is all there is (a sequence is then always alone)
        self.pad_lone = self.decodes and self.max_seqs > 1
        self.store = None  # the daemon's prefix cache: blocks of prompt KV, shared by its workers
        if spec.prefix_store and self.sliding_window:
            log.info("no prefix cache for %s: its sliding-window layers' KV is not kept in blocks", self.arch)
        elif spec.prefix_store:
            from syshaxd.sdk.kv.block_store import BlockStore

            self.store = BlockStore.attach(spec.prefix_store)
        self.fingerprint = fingerprint_from_gguf(path)  # reads the KV out of a state (the proofs, the prefix cache)

        self.free_slots = self.max_seqs
        self.streams = StreamRun(self.max_seqs)  # a decoding sequence's KV stream: seq_id in the batch context
        self.waiting: deque[_Sequence] = deque()
        self.active: dict[str, _Sequence] = {}  # request_id -> sequence holding a seq_id
        self.queued: dict[str, _Sequence] = {}  # request_id -> sequence waiting for a slot
        self.counters = {"prompt_tokens": 0, "generated_tokens": 0, "steps": 0, "finished": 0, "decode_errors": 0,
                         "stream_moves": 0, "cached_tokens": 0, "padded_steps": 0}
        self._rate = TokenRate()
        log.info(
            "llama.cpp engine built: %s, n_ctx=%d per sequence, batch=%d seqs, chunk=%d, threads=%d, kernels %s",
            path.name, self.n_ctx, self.max_seqs, self.chunk, spec.threads, self.kernels.kernels,
        )

    def batch_params(self, n_batch: int):
        """The batch context's parameters, with room for n_batch tokens per llama_decode (the benches under bench/
        build twins of it with more room)."""
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = self.seq_ctx * self.max_seqs
        cparams.n_batch = cparams.n_ubatch = n_batch
        cparams.n_seq_max = self.max_seqs
        # One KV stream per slot, each of n_ctx cells. In a unified cache a finished sequence
        # leaves holes that the others' next tokens fill, so a sequence's cells stop being in
        # position order and the attention sums round differently than for the request alone
        # (measured: 9 of 16 staggered requests kept their alone-text unified, 16 of 16 split;
        # decode speed is the same once prompts run in their own context, below).
        cparams.kv_unified = False
        cparams.n_threads = cparams.n_threads_batch = self.spec.threads
        cparams.no_perf = True
        # Flash attention walks a sequence's own cells in order; the plain path sums over all
        # cells of the batch, so neighbours change the rounding (measured: 16 prompts batched
        # 8 at a time kept 16/16 of their alone-text with it, 7/16 without).
        cparams.flash_attn_type = 1
        return cparams

    # --- Engine protocol ------------------------------------------------------------------

    def info(self) -> dict:
        return {
            "backend": "llamacpp",
            "role": self.spec.role,
            "model_path": str(self.model_path),
            "model_name": self.spec.model_name,
            "n_ctx": self.n_ctx,
            "n_ctx_train": self.n_ctx_train,
            "n_vocab": self.n_vocab,
            "max_batch_size": self.max_seqs,
            "prefill_chunk_size": self.chunk,
            "threads": self.spec.threads,
            "chat_template": self.vocab.template.source,
            "prefix_cache": self.store is not None,
            "repack": self.spec.repack,
            "kernels": self.kernels.kernels,
            "kernels_why": self.kernels.why,
            "exact_resume_tokens": self.exact_resume,
            "attention": "tiled" if self.tiled_attention else "llama.cpp",
            "exact_decode": self.exact_decode,
            "keeps_generated": self.keeps_generated,
            "lone_padding": self.pad_lone,
        }

    def proofs(self) -> Proofs:
        return Proofs(self.exact_decode, self.exact_resume, self.pad_lone)

    def safer_kernels(self) -> tuple[dict, str]:
        if not self.kernels.fallback:
            return {}, ""
        return {"repack": self.kernels.fallback}, f"weight repacking ({self.kernels.kernels} kernels)"

    def warm_up(self) -> None:
        """One full prompt chunk, a state export and import into every batch stream, and one full decode batch:
        what serving runs, so that kernels which crash on this CPU crash here, before the worker says ready.
        With a prefix cache, then the proof that the prompt's bits do not depend on where its chunks start."""
        n = min(self.chunk, self.seq_ctx - 1)  # room for the decode step's token after it
        # token ids spread over the vocabulary: a prompt's rows as any text gives them
        tokens = [(7 + 31 * i) % self.n_vocab for i in range(n)]
        b = self.prefill_batch
        b.n_tokens = 0
        for pos, token in enumerate(tokens):
            self._add(b, token, pos, 0, pos == n - 1)
        reference = None
        try:
            if llama_cpp.llama_decode(self.prefill_ctx, b) != 0:
                raise RuntimeError(f"warm-up: llama_decode of a {n}-token prompt chunk failed")
            size = llama_cpp.llama_state_seq_get_size(self.prefill_ctx, 0)
            buf = self._state.ensure(size + 8 * self.max_seqs)  # widen_streams: 2 KV caches at most
            export_seq(self.prefill_ctx, 0, self._state)
            reference = (buf[:size].copy(), np.ctypeslib.as_array(
                llama_cpp.llama_get_logits_ith(self.prefill_ctx, n - 1), (self.n_vocab,)).copy())
            if self.decodes:
                size = widen_streams(buf, size, self.max_seqs)
                self.batch.n_tokens = 0
                for stream in range(self.max_seqs):
                    got = llama_cpp.llama_state_seq_set_data(self.ctx, StateBuffer.pointer(buf), size, stream)
                    if got != size:
                        raise RuntimeError(f"warm-up: the prompt's state did not import into stream {stream}")
                    self._add(self.batch, tokens[stream % n], n, stream, True)
                if llama_cpp.llama_decode(self.ctx, self.batch) != 0:
                    raise RuntimeError(f"warm-up: llama_decode of a {self.max_seqs}-row decode batch failed")
            proven = self.spec.proven  # an earlier warm-up of this worker proved these on this CPU and build
            if proven is not None:
                self.exact_decode, self.exact_resume, self.pad_lone = (
                    proven.exact_decode, proven.exact_resume, proven.pad_lone and self.pad_lone)
                log.info("proofs kept from this worker's earlier warm-up: %s", self._proved_words())
            else:
                if self.tiled_attention:
                    self.exact_decode = (self._proves_decode_kv(tokens + [tokens[0]]) if self.decodes
                                         else self._proves_any_chunking(tokens, *reference))
                if self.pad_lone:
                    self.pad_lone = not self._proves_lone(tokens[0], n)
                if self.exact_decode:
                    self.exact_resume = 1  # a chunk of any size gives the bits, wherever it starts
                elif self.store is not None:
                    self.exact_resume = self._prove_chunking(tokens, *reference)
        finally:
            llama_cpp.llama_memory_seq_rm(self.prefill_memory, 0, -1, -1)
            if self.decodes:
                for stream in range(self.max_seqs):
                    llama_cpp.llama_memory_seq_rm(self.memory, stream, -1, -1)
        self.keeps_generated = self.exact_decode and self.decodes and self.spec.keep_generated and self.store is not None

    def _proved_words(self) -> str:
        return (f"decode steps {'give' if self.exact_decode else 'may not give'} a prompt chunk's bits, prefix hits "
                f"resume inside chunks of {self.exact_resume or 'whole'} tokens or more, a lone sequence "
                f"{'decodes beside a padding row' if self.pad_lone else 'needs no padding row'}")

    def _proves_decode_kv(self, history: list[int]) -> bool:
        """Whether stream 0 of the decode batch just run -- its prompt from one chunk, its last token from the
        decode step -- holds the very KV bytes, and its row the very logits, that the prefill context gives the
        same tokens in chunks of 1, 16 and the rest: true where every query row's attention is tiled
        (TILED_ATTENTION_ENV with mk/llama-wheel.sh's llama.cpp), so a decoded token's KV can be kept as if a prompt
        had computed it. Leaves the prefill context empty."""
        n = len(history)
        batched = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, 0), (self.n_vocab,)).copy()
        decoded = export_seq(self.ctx, 0, self._state).copy()  # every KV cache of the model's (gemma: two)
        cuts = [0, 1]  # a row alone, then 16 rows, then chunks as long as they come
        while cuts[-1] < n:
            cuts.append(min(n, cuts[-1] + (min(16, self.chunk) if len(cuts) == 2 else self.chunk)))
        llama_cpp.llama_memory_seq_rm(self.prefill_memory, 0, -1, -1)
        try:
            logits = self._run_cuts(history, cuts)
            # the prompt's state, addressed as the batch context's stream 0: the same bytes where every K and V
            # (and every position) is the same
            size = llama_cpp.llama_state_seq_get_size(self.prefill_ctx, 0)
            buf = self._state.ensure(size + 8 * self.max_seqs)
            export_seq(self.prefill_ctx, 0, self._state)
            size = widen_streams(buf, size, self.max_seqs)
            same = np.array_equal(logits, batched) and np.array_equal(buf[:size], decoded)
        finally:
            llama_cpp.llama_memory_seq_rm(self.prefill_memory, 0, -1, -1)
        if faults.fails_proof(self.spec.fault, "generated"):
            same = False
        if same:
            sizes = ", ".join(str(e - s) for s, e in zip(cuts, cuts[1:]))
            log.info("a decode step and prompt chunks of %s tokens give the same bits: prefix hits resume after any "
                     "block, and a resumed request gets the undisturbed run's tokens%s", sizes,
                     ", and what a request generates is kept" if self.spec.keep_generated and self.store else "")
        else:
            log.warning("a decode step gives other bits than a prompt chunk here (a llama.cpp not built by "
                        "mk/llama-wheel.sh?): nothing generated is kept, and a resumed request may part from its "
                        "undisturbed text at a near-tie")
        return same

    def _proves_any_chunking(self, tokens: list[int], state: np.ndarray, logits: np.ndarray) -> bool:
        """A prefill-only worker's _proves_decode_kv (it has no decode batch): whether the warm-up prompt, run again in
        chunks of 1, 16 and the rest, gives the very KV bytes and last logits it gave in one chunk -- true with every
        query row's attention tiled, so that its records are what a decoder's own prompt pass would give."""
        n = len(tokens)
        cuts = [c for c in (0, 1, min(17, n)) if c < n] + [n]
        try:
            last = self._run_cuts(tokens, cuts)
            same = np.array_equal(export_seq(self.prefill_ctx, 0, self._state), state) and np.array_equal(last, logits)
        finally:
            llama_cpp.llama_memory_seq_rm(self.prefill_memory, 0, -1, -1)
        if faults.fails_proof(self.spec.fault, "generated"):
            same = False
        sizes = ", ".join(str(e - s) for s, e in zip(cuts, cuts[1:]))
        if same:
            log.info("prompt chunks of %s tokens give the bits of one chunk: this worker's KV is a decoder's own", sizes)
        else:
            log.warning("prompt chunks of %s tokens give other bits than one chunk here (a llama.cpp not built by "
                        "mk/llama-wheel.sh?): its decoders' tokens may part from cpu mode's at a near-tie", sizes)
        return same

    def _proves_lone(self, token: int, n: int) -> bool:
        """Whether a row decoded alone gets the bits the same row got in the full batch just decoded (stream 0's,
        `token` at position n after n cells): true with a llama.cpp that never splits a lone row's attention among
        its threads (mk/llama-wheel.sh's build), false with a stock one. Only a KV past SPLIT_KV_FROM cells can
        tell the two apart; with a shorter warm-up prompt it is not proved, and a lone sequence keeps its padding
        row."""
        if n + 1 <= SPLIT_KV_FROM:
            log.info("a lone sequence decodes beside a padding row (a %d-token warm-up cannot prove it need not)", n)
            return False
        batched = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, 0), (self.n_vocab,)).copy()
        for stream in range(1, self.max_seqs):
            llama_cpp.llama_memory_seq_rm(self.memory, stream, -1, -1)
        llama_cpp.llama_memory_seq_rm(self.memory, 0, n, -1)
        self.batch.n_tokens = 0
        self._add(self.batch, token, n, 0, True)
        if llama_cpp.llama_decode(self.ctx, self.batch) != 0:
            raise RuntimeError("warm-up: llama_decode of a lone row failed")
        alone = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, 0), (self.n_vocab,))
        same = np.array_equal(alone, batched) and not faults.fails_proof(self.spec.fault, "lone")
        if same:
            log.info("a lone sequence past %d tokens gets the bits it gets in a batch: it decodes without a padding "
                     "row", SPLIT_KV_FROM)
        else:
            log.warning("this llama.cpp splits a lone row's attention among its threads (not built by "
                        "mk/llama-wheel.sh?): a lone sequence past %d tokens decodes beside a padding row, 1 to 2 "
                        "ms a step, so that its text is the one it gets beside others", SPLIT_KV_FROM)
        return same

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
            again = export_seq(self.prefill_ctx, 0, self._state)
            same = np.array_equal(again, state) and np.array_equal(last, logits)
        finally:
            llama_cpp.llama_memory_seq_rm(self.prefill_memory, 0, -1, -1)
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
        llama_cpp.llama_memory_seq_rm(self.prefill_memory, 0, -1, -1)
        b = self.prefill_batch
        for start, end in zip(cuts, cuts[1:]):
            b.n_tokens = 0
            for pos in range(start, end):
                self._add(b, tokens[pos], pos, 0, pos == len(tokens) - 1)
            if llama_cpp.llama_decode(self.prefill_ctx, b) != 0:
                raise RuntimeError(f"warm-up: llama_decode of a {end - start}-token prompt chunk failed")
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.prefill_ctx, b.n_tokens - 1), (self.n_vocab,))

    def submit(self, request: GenerateRequest, handling: Handling = Handling()) -> list:
        rid = request.request_id
        if handling.handoff and self.port is None:
            return [Rejected(rid, Refusal.FAILED, "this engine has no KV ring to hand the prompt on through",
                             "engine_error")]
        if request.grammar and not grammar_parses(self.vocab.vocab, request.grammar):
            return [Rejected(rid, Refusal.INVALID, "llama.cpp could not parse the grammar built from "
                             f"'{request.grammar_field}'; check a grammar's syntax, or simplify a schema (a "
                             "'pattern', most likely).",
                             "unsupported_schema", request.grammar_field)]
        fitted = fit_prompt(self.vocab, request, self.n_ctx)
        if isinstance(fitted, Rejected):
            return [fitted]
        prompt, max_tokens = fitted
        prompt += handling.resume_tokens  # a decode moved here continues after what it generated
        seq = _Sequence(request=request, prompt=prompt, max_tokens=max_tokens, started=time.monotonic(),
                        handling=handling)
        plan = handling.prefix
        if (plan is not None and self.store is not None and plan.chunk_tokens == self.chunk
                and not handling.resume_tokens):
            # the records written by now are checked now, so the answer's usage can say what is reused; the plan's
            # records are held for this request until it reports, and those written meanwhile are checked when
            # its prompt runs
            seq.found = prefix.find(self.store, self.fingerprint, plan, prompt, self.n_vocab, written_only=True)
            seq.cached = True
            seq.hit_tokens = sum(r.n_tokens for r in prefix.usable(seq.found, plan, len(prompt), self.exact_resume))
        accepted = Accepted(rid, len(prompt), max_tokens, cached_tokens=seq.hit_tokens)
        if not self._needs_slot(seq):
            # a prompt only handed on runs in the prompt context and holds no batch slot: it starts at once,
            # or an offloaded request's prefill would wait here for a whole generation to end
            return [accepted, *self._start(seq)]
        self.waiting.append(seq)
        self.queued[rid] = seq
        return [accepted]

    def cancel(self, request_id: str) -> list:
        seq = self.queued.pop(request_id, None)
        if seq is not None:
            self.waiting.remove(seq)
            if seq.handling.kv is not None:  # the daemon's ledger frees the record once it hears it was not read
                return [Imported(request_id, False, reason=Fallback.CANCELLED)]
            return []
        seq = self.active.get(request_id)
        if seq is not None:
            self._release(seq)
        return []

    def has_work(self) -> bool:
        return bool(self.active) or (bool(self.waiting) and self.free_slots > 0)

    def step(self) -> list:
        """One llama_decode for every decoding sequence, then one chunk of the oldest prompt."""
        deltas = self._admit()
        if not self.active:
            return deltas
        self._compact()
        rows = []
        self.batch.n_tokens = 0
        # in stream order: with the streams one consecutive run, llama.cpp takes the batch in one ubatch
        decoding = sorted((s for s in self.active.values() if s.next_token is not None), key=lambda s: s.seq_id)
        pad = self._pad_stream(decoding)
        for seq in decoding:
            if 0 <= pad < seq.seq_id:
                self._add(self.batch, seq.next_token, 0, pad, False)
            rows.append((seq, self._add(self.batch, seq.next_token, seq.n_past, seq.seq_id, True)))
            if pad > seq.seq_id:
                self._add(self.batch, seq.next_token, 0, pad, False)
            seq.n_past += 1
            seq.fed.append(seq.next_token)
            seq.next_token = None
        if rows:
            rc = llama_cpp.llama_decode(self.ctx, self.batch)
            if pad >= 0:
                llama_cpp.llama_memory_seq_rm(self.memory, pad, -1, -1)
                self.counters["padded_steps"] += 1
            self.counters["steps"] += 1
            if rc != 0:
                return self._fail(rc, [seq for seq, _ in rows])
            for seq, i in rows:
                try:
                    deltas += self._emit(seq, *self._sample(seq, self.ctx, i))
                except GrammarDeadEnd:
                    deltas += self._dead_end(seq)
        seq = next((s for s in self.active.values() if s.pending), None)
        if seq is not None:
            deltas += self._prefill_chunk(seq)
        self._count(len(deltas))
        return deltas

    def _pad_stream(self, decoding: list[_Sequence]) -> int:
        """A free stream next to a lone decoding sequence's, for a one-token row beside it; -1 when none is needed.

        Only with a stock llama.cpp (pad_lone: the warm-up's proof, _proves_lone; mk/llama-wheel.sh builds one that
        never splits). With one query row in the ubatch and 512 KV cells or more (a sequence past 256 tokens), its
        CPU flash attention splits the KV among its threads and sums the parts (ops.cpp, use_split_kv_path); with
        two streams in the ubatch it walks every row's KV in order. The two sum differently, so a sequence
        decoded alone would get other bits than in a batch (bench/bench_concurrent_exactness.py): a row in a
        second stream keeps a lone sequence on the batch's path, and its text the same alone or not. The price:
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

    def _prefill_chunk(self, seq: _Sequence) -> list:
        """Feed the next chunk of seq's prompt to the prefill context; at its end, hand it over."""
        logits = self._import_hits(seq) if seq.cached and seq.n_past == 0 else None
        if logits is not None:  # the whole prompt came from the cache: nothing to evaluate
            try:
                token = sample_logits(seq.sampler, logits, grammar=bool(seq.request.grammar))
            except GrammarDeadEnd:
                return self._dead_end(seq)
            k = seq.request.logprobs
            lp = logprobs.of_logits(logits, token, k) if k is not None else None
        else:
            b = self.prefill_batch
            b.n_tokens = 0
            # up to the next multiple of the chunk: a prompt resumed after cached blocks then runs the chunks a
            # prompt run from the start runs
            take = min(len(seq.pending), self.chunk - seq.n_past % self.chunk)
            start = seq.n_past
            every = seq.prompt_lp is not None  # echo's prompt logprobs: logits for every position
            for _ in range(take):
                last = len(seq.pending) == 1
                self._add(b, seq.pending.popleft(), seq.n_past, 0, last or every)
                seq.n_past += 1
            rc = llama_cpp.llama_decode(self.prefill_ctx, b)
            if rc != 0:
                llama_cpp.llama_memory_seq_rm(self.prefill_memory, 0, -1, -1)
                return self._fail(rc, [seq])
            if every:  # row j predicts the prompt's token after position start + j
                seq.prompt_lp += logprobs.prompt_chunk(self.prefill_ctx, take, self.n_vocab,
                                                       seq.prompt[start + 1:start + take + 1],
                                                       seq.request.prompt_logprobs)
            if seq.pending:
                return []
            if seq.handling.prefix is not None and seq.handling.prefix.final_store >= 0:  # kept with the prompt
                logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.prefill_ctx, b.n_tokens - 1),
                                               (self.n_vocab,)).copy()
            try:
                token, lp = self._sample(seq, self.prefill_ctx, b.n_tokens - 1)
            except GrammarDeadEnd:
                llama_cpp.llama_memory_seq_rm(self.prefill_memory, 0, -1, -1)
                return self._dead_end(seq)
        if not self.decodes or seq.handling.handoff:
            cached = self._keep_blocks(seq, None, logits)
            return [*cached, self._hand_on(seq, token, lp)]
        size = llama_cpp.llama_state_seq_get_size(self.prefill_ctx, 0)
        buf = self._state.ensure(size + 8 * self.max_seqs)  # widen_streams: 2 KV caches at most
        export_seq(self.prefill_ctx, 0, self._state)
        cached = self._keep_blocks(seq, buf[:size], logits)
        llama_cpp.llama_memory_seq_rm(self.prefill_memory, 0, -1, -1)
        size = widen_streams(buf, size, self.max_seqs)
        seq.seq_id = self.streams.take()  # it joins the decode batch now, next to the others
        got = llama_cpp.llama_state_seq_set_data(self.ctx, StateBuffer.pointer(buf), size, seq.seq_id)
        if got != size:
            return cached + self._fail(-1, [seq], "could not move the prompt's KV into the batch context")
        return [*cached, *self._emit(seq, token, lp)]

    def _import_hits(self, seq: _Sequence) -> np.ndarray | None:
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

    def _keep_blocks(self, seq: _Sequence, state_bytes, logits) -> list:
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

    def _count(self, n: int) -> None:
        self._rate.add(n)
        self.counters["generated_tokens"] += n

    def stats(self) -> EngineStats:
        return EngineStats(running=len(self.active), waiting=len(self.waiting), free_slots=self.free_slots,
                           max_batch_size=self.max_seqs, n_ctx=self.n_ctx,
                           kv_usage=sum(s.n_past for s in self.active.values()) / (self.n_ctx * self.max_seqs),
                           tokens_per_second=self._rate.per_second(), **self.counters)

    def close(self) -> None:
        for seq in list(self.active.values()):
            self._release(seq)
        if self.port is not None:
            self.port.close()
        if self.store is not None:
            self.store.close()
        for name in ("batch", "prefill_batch"):
            if getattr(self, name) is not None:
                llama_cpp.llama_batch_free(getattr(self, name))
                setattr(self, name, None)
        for name in ("ctx", "prefill_ctx"):
            if getattr(self, name) is not None:
                llama_cpp.llama_free(getattr(self, name))
                setattr(self, name, None)
        if self.model is not None:
            llama_cpp.llama_model_free(self.model)
            self.model = None

    # --- internals ------------------------------------------------------------------------

    def _needs_slot(self, seq: _Sequence) -> bool:
        """A sequence that decodes here holds a batch slot; a prompt that is only handed on (prefill role, or
        auto mode offloading its decode) runs in the prompt context alone and holds none."""
        return self.decodes and not seq.handling.handoff

    def _admit(self) -> list:
        # FIFO: the head of the queue is never overtaken, so a long request is not starved
        deltas = []
        while self.waiting and self.free_slots > 0:
            seq = self.waiting.popleft()
            del self.queued[seq.request.request_id]
            seq.slotted = True
            self.free_slots -= 1
            deltas += self._start(seq)
        return deltas

    def _start(self, seq: _Sequence) -> list:
        """Make seq active: a sampler, its text stream, and its prompt to evaluate or its KV to import."""
        try:  # a decode moved here continues its grammar (and penalties) after what it generated
            seq.sampler = make_sampler(seq.request.sampling, self.n_vocab, seq.request.grammar, self.vocab.vocab,
                                       seq.handling.resume_tokens)
        except GrammarError as exc:
            return self._fail(-1, [seq], str(exc))
        seq.out = SequenceOutput.for_request(seq.request, seq.max_tokens, self.vocab.is_eog, self.vocab.piece_bytes,
                                             seq.handling.resume_tokens)
        if seq.request.prompt_logprobs is not None:
            seq.prompt_lp = [None]
        self.active[seq.request.request_id] = seq
        self.counters["prompt_tokens"] += len(seq.prompt)
        if seq.handling.kv is not None or seq.handling.kv_missing:
            return self._take_kv(seq)
        seq.pending = deque(seq.prompt)
        return []

    def _take_kv(self, seq: _Sequence) -> list:
        """Start seq from the KV another engine computed; if it cannot be used, recompute the prompt."""
        from syshax_llamacpp.handoff import ImportRefused

        rid, handle = seq.request.request_id, seq.handling.kv
        reason = seq.handling.kv_missing
        started = time.monotonic()
        if handle is not None:
            seq.seq_id = self.streams.take()
            try:
                if self.port is None:
                    raise ImportRefused(Fallback.NO_RING, "this worker has no KV ring")
                nbytes = self.port.import_into(self.ctx, seq.seq_id, handle, seq.prompt)
            except ImportRefused as exc:
                reason = exc.reason
                llama_cpp.llama_memory_seq_rm(self.memory, seq.seq_id, -1, -1)
                self.streams.give_back(seq.seq_id)  # it joins when its recomputed prompt is done
                seq.seq_id = -1
                log.warning("%s: KV record unusable (%s: %s); recomputing the prompt here", rid, reason, exc)
            else:
                seq.n_past = len(seq.prompt)
                took = time.monotonic() - started
                if handle.prompt_logprobs is not None:  # computed by the prefill engine, as this one would
                    seq.prompt_lp = list(handle.prompt_logprobs)
                # the prefill engine sampled the first token: the chain here (its grammar) must see it too
                if not accept(seq.sampler, handle.first_token, bool(seq.request.grammar)):
                    return [Imported(rid, True, seconds=took, nbytes=nbytes),
                            *self._fail(-1, [seq], "the prefill engine's first token breaks the grammar")]
                return [Imported(rid, True, seconds=took, nbytes=nbytes),
                        *self._emit(seq, handle.first_token, handle.first_logprob)]
        else:
            log.warning("%s: no KV record (%s); recomputing the prompt here", rid, reason)
        seq.pending = deque(seq.prompt)
        return [Imported(rid, False, reason=reason)]

    def _hand_on(self, seq: _Sequence, token: int, lp: TokenLogprob | None) -> Prefilled:
        """Prefill role: write the prompt's KV into the ring and let the sequence go."""
        from syshaxd.sdk.kv.ring import RingError

        rid = seq.request.request_id
        try:
            handle = self.port.export(self.prefill_ctx, 0, seq.prompt, token)
        except RingError as exc:
            log.warning("%s: KV record not written (%s); the decoder will recompute the prompt", rid, exc)
            event = Prefilled(rid, None, Fallback.of_export(exc))
        else:
            prompt_lp = tuple(seq.prompt_lp) if seq.prompt_lp is not None else None
            event = Prefilled(rid, replace(handle, first_logprob=lp, prompt_logprobs=prompt_lp))
        llama_cpp.llama_memory_seq_rm(self.prefill_memory, 0, -1, -1)
        self._release(seq)
        self.counters["finished"] += 1
        return event

    @staticmethod
    def _add(b, token: int, pos: int, seq_id: int, logits: bool) -> int:
        i = b.n_tokens
        b.token[i] = token
        b.pos[i] = pos
        b.n_seq_id[i] = 1
        b.seq_id[i][0] = seq_id
        b.logits[i] = logits
        b.n_tokens = i + 1
        return i

    def _sample(self, seq: _Sequence, ctx, i: int) -> tuple[int, TokenLogprob | None]:
        """The next token from batch row i, and its logprob when the request asked for them. GrammarDeadEnd when
        the request's grammar allows no token: sampled by hand then, as llama.cpp would abort the process."""
        if seq.request.grammar:
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), (self.n_vocab,))
            token = sample_logits(seq.sampler, logits, grammar=True)
        else:
            token = llama_cpp.llama_sampler_sample(seq.sampler, ctx, i)
        k = seq.request.logprobs
        return token, (logprobs.at(ctx, i, self.n_vocab, token, k) if k is not None else None)

    def _emit(self, seq: _Sequence, token: int, lp: TokenLogprob | None = None) -> list:
        """The Delta of a token; at the sequence's end, after the blocks of what it generated that it keeps."""
        text, finish = seq.out.token(token)
        kept = []
        if finish is None:
            seq.next_token = token
        else:
            kept = self._keep_generated(seq)
            self._release(seq)
            self.counters["finished"] += 1
        # the end-of-generation token that ends the text is not part of it: no logprob entry
        ended = finish == "stop" and self.vocab.is_eog(token) and not seq.request.ignore_eos
        prompt_lp, seq.prompt_lp = (tuple(seq.prompt_lp) if seq.prompt_lp is not None else None), None
        return [*kept, Delta(seq.request.request_id, text, 1, finish, tokens=(token,),
                             logprobs=(lp,) if lp is not None and not ended else (), prompt_logprobs=prompt_lp)]

    def _keep_generated(self, seq: _Sequence) -> list:
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

    def _release(self, seq: _Sequence) -> None:
        """Remove the sequence from the KV cache and give its slot back."""
        self.active.pop(seq.request.request_id, None)
        if seq.pending and seq.n_past > 0:
            # cut off halfway through its prompt: the prefill context still holds that part
            llama_cpp.llama_memory_seq_rm(self.prefill_memory, 0, -1, -1)
            seq.pending.clear()
        if seq.seq_id >= 0:
            llama_cpp.llama_memory_seq_rm(self.memory, seq.seq_id, -1, -1)
            self.streams.give_back(seq.seq_id)  # a hole, if it was inside the run: the next step fills it
            seq.seq_id = -1
        if seq.slotted:
            self.free_slots += 1
            seq.slotted = False
        if seq.sampler is not None:
            llama_cpp.llama_sampler_free(seq.sampler)
            seq.sampler = None

    def _compact(self) -> None:
        """Fill each hole in the run of decoding streams with the end of the run that holds fewer tokens."""
        while holes := self.streams.holes():
            by_stream = {s.seq_id: s for s in self.active.values() if s.seq_id >= 0}
            lo, hi = self.streams.ends()
            if not self._move(min(by_stream[lo], by_stream[hi], key=lambda s: s.n_past), holes[0]):
                break

    def _move(self, seq: _Sequence, target: int) -> bool:
        """Move seq's KV into stream `target` of the batch context: the same bytes, so the same next tokens."""
        size = llama_cpp.llama_state_seq_get_size(self.ctx, seq.seq_id)
        buf = export_seq(self.ctx, seq.seq_id, self._state)
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

    def _dead_end(self, seq: _Sequence) -> list:
        """The request's grammar allows no token at this point: end it with an error that says so -- a 400 naming
        the field while nothing was generated (no token of the vocabulary can start the output), else an error
        after the text so far."""
        done = seq.out.n_generated if seq.out is not None else 0
        field = seq.request.grammar_field
        if done == 0:
            self._release(seq)
            return [Rejected(seq.request.request_id, Refusal.INVALID, f"The output constraint '{field}' allows no "
                             "first token: no token of this model's vocabulary can start it. Check the grammar or "
                             "pattern.",
                             "unsupported_schema", field)]
        return self._fail(-1, [seq], f"the output constraint ('{field}') allows no token after {done} tokens: it "
                                     "has no way on here; check the grammar or pattern")

    def _fail(self, rc: int, seqs: list, why: str = "") -> list:
        """llama.cpp refused a pass: end those sequences with an error rather than guess."""
        self.counters["decode_errors"] += 1
        why = why or f"llama_decode failed ({rc})"
        log.error("%s; failing %d sequences", why, len(seqs))
        deltas = []
        for seq in seqs:
            self._release(seq)
            deltas.append(Delta(seq.request.request_id, "", 0, "error", why))
        return deltas
