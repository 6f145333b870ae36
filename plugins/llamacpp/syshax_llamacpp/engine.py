"""The llama.cpp CPU engine: up to max_batch_size sequences decoded per llama_decode, prompts run beside them.

LlamaCppEngine is the SDK's Engine: it owns the model and its two contexts (contexts.py loads and sets them
up), takes requests in (submit, cancel; each a Sequence, sequence.py), says how it stands (info, stats) and frees
it all (close). Its other jobs each live in a module of their own, a class whose methods it takes on:

* proofs.py (WarmUpProofs): the warm-up, and what it proves of this llama.cpp build;
* stepping.py (Stepping): one step -- slots, the decode batch, prompt chunks, the KV streams;
* prefix_side.py (PrefixSide): the prefix cache's hits and writes (prefix.py reads and writes its blocks), and a
  prompt's start from a whole state that checkpoints.py kept, for a model those blocks do not carry;
* handoff.py (HandoffSide): a KV record in from a prefill engine, or out to a decoder;
* sampling.py (SamplingSide): the next token of a row, and a grammar's dead end.

They share the engine's state (its contexts, batches, sequences and counters) rather than each owning a part:
a step touches all of it.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import llama_cpp

from syshax_llamacpp import drafting, prefix
from syshax_llamacpp.checkpoints import Checkpoints
from syshax_llamacpp.codec import StateBuffer
from syshax_llamacpp.contexts import add_row, batch_params, load_model, prompt_params
from syshax_llamacpp.draft_model import DraftModel
from syshax_llamacpp.handoff import HandoffSide, KVPort
from syshax_llamacpp.kernels import library_build
from syshax_llamacpp.prefix_side import PrefixSide
from syshax_llamacpp.proofs import WarmUpProofs
from syshax_llamacpp.sampling import GrammarError, SamplingSide, grammar_parses, make_sampler
from syshax_llamacpp.sequence import Sequence
from syshax_llamacpp.stepping import Stepping
from syshax_llamacpp.streams import StreamRun
from syshaxd.sdk.gguf.header import fingerprint_from_gguf
from syshaxd.sdk.gguf.quantize import weight_types
from syshaxd.sdk.gguf.vocab import Vocab
from syshaxd.sdk.output import SequenceOutput
from syshaxd.sdk.prompt_fit import fit_prompt
from syshaxd.sdk.rate import TokenRate
from syshaxd.sdk.types import (Accepted, Delta, EngineSpec, EngineStats, Fallback, GenerateRequest, Handling,
                               Imported, Proofs, Refusal, Rejected)

log = logging.getLogger(__name__)


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


class LlamaCppEngine(WarmUpProofs, Stepping, PrefixSide, HandoffSide, SamplingSide):
    """Continuous batching: sequences join and leave the running batch at any step.

    A sequence enters decoding either by evaluating its prompt here (`pending` tokens, fed to the prompt
    context in chunks of at most prefill_chunk_size per step, its KV then moved into the batch context), or
    by having a prefill engine's KV record set into `seq_id` and its first token given (handoff.py); the
    decode loop does not care which.
    """

    def __init__(self, spec: EngineSpec, on_graph: Callable[[], None] | None = None) -> None:
        """on_graph (tests, diagnostics): called for every graph llama.cpp computes on the batch context --
        once per ubatch -- through its eval callback, which costs a Python call per graph node."""
        self.spec = spec
        loaded = load_model(spec)
        self.model_path, self.model, self.kernels = loaded.path, loaded.model, loaded.kernels
        self.tiled_attention = loaded.tiled_attention
        self.arch, self.sliding_window = loaded.arch, loaded.sliding_window
        self.state = loaded.state  # how a sequence's state is laid out: widen_streams reads it
        self.weight_types = weight_types(self.model_path)  # what the kernels multiply: the proofs' warnings name them
        self.vocab = Vocab(model=self.model)  # tokenizing, chat template and pieces, as every engine does them
        self.n_vocab = self.vocab.n_vocab
        self.n_ctx_train = llama_cpp.llama_model_n_ctx_train(self.model)

        self.max_seqs = spec.max_batch_size
        self.chunk = spec.prefill_chunk_size
        # the batch context decodes one token per sequence, or a lone sequence's and its guessed next ones
        # (speculative decoding: stepping._guesses says why only a lone one's); no more room than that: llama.cpp
        # reserves its compute buffer for the room (the default model: 1.6 MiB for 8 rows, 12.8 MiB for 64), though
        # a step takes no longer in a roomier context (bench/bench_verify_rows.py --room)
        self.speculative_tokens = spec.speculative_tokens if spec.role != "prefill" else 0
        if self.speculative_tokens and self.state.recurrent:
            # a guess refused must leave the KV: a recurrent state holds every token in one cell and cannot drop the
            # last ones (llama_memory_seq_rm refuses a partial range)
            log.info("speculative decoding off: %s's recurrent state cannot drop a refused guess", self.arch)
            self.speculative_tokens = 0
        self.n_batch = max(self.max_seqs, 1 + self.speculative_tokens)
        if spec.guess_always:  # the tests' every guess of every sequence, checked
            self.n_batch = self.max_seqs * (1 + self.speculative_tokens)
        # a lone sequence's decode step time by its rows, learnt as steps run: whether a guess pays (drafting.py);
        # None while speculation is off (set at the warm-up, once it proved that rows give a lone row's bits)
        self.step_cost: drafting.StepCost | None = None
        self.match_rates = drafting.MatchRates()  # ... and how sure a guess is by the match it follows
        self.seq_ctx = min(spec.n_ctx, self.n_ctx_train)
        cparams = self.batch_params(self.n_batch)
        if on_graph is not None:
            self._eval_callback = _graph_observer(on_graph)  # kept: llama.cpp holds only the pointer
            cparams.cb_eval = self._eval_callback
        # a prefill-only worker hands every prompt on and never decodes: no batch context
        self.decodes = spec.role != "prefill"
        self.ctx = llama_cpp.llama_init_from_model(self.model, cparams) if self.decodes else None
        # prompts run alone, in a context of their own (contexts.prompt_params says why)
        pparams = prompt_params(spec, self.seq_ctx, self.chunk, cparams.flash_attn_type)
        self.prefill_ctx = llama_cpp.llama_init_from_model(self.model, pparams)
        if (self.decodes and self.ctx is None) or self.prefill_ctx is None:
            raise RuntimeError("llama.cpp could not create a context (out of memory?)")
        self.prefill_memory = llama_cpp.llama_get_memory(self.prefill_ctx)
        # guesses from a draft model rather than the sequence's own context (config draft_model)
        self.draft: DraftModel | None = None
        if spec.draft_model and self.speculative_tokens and self.decodes:
            self.draft = DraftModel(spec.draft_model, self.model, n_ctx=self.seq_ctx, chunk=self.chunk,
                                    threads=spec.threads, use_extra_bufts=self.kernels.use_extra_bufts)
        self.prefill_batch = llama_cpp.llama_batch_init(self.chunk, 0, 1)
        self._state = StateBuffer()
        # (sequence, state bytes, last logits) of the prompt whose blocks are to be written at the next step
        # (stepping.py); the prompt context holds its KV until then
        self._unkept = None
        self.n_ctx = self.seq_ctx  # the most tokens one sequence may hold (prompt + completion)
        self.memory = llama_cpp.llama_get_memory(self.ctx) if self.decodes else None
        self.batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self.port = None
        if spec.ring:
            self.port = KVPort(spec.ring, str(self.model_path), n_stream=self.max_seqs, timeout=spec.handoff_timeout,
                               whole_state=loaded.whole_state, shape=self.state)
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
        if spec.prefix_store and (self.sliding_window or not self.state.plain):
            what = ("recurrent state stands for all its tokens" if self.state.recurrent else
                    "KV cells carry M-RoPE positions" if self.state.cell_ext else "sliding-window layers' KV")
            log.info("no prefix cache for %s: its %s, which blocks of K and V rows do not keep", self.arch, what)
        elif spec.prefix_store:
            from syshaxd.sdk.kv.block_store import BlockStore

            self.store = BlockStore.attach(spec.prefix_store)
        # whole states after prompts, where the plan asks for them instead of the prefix cache's blocks
        self.checkpoints: Checkpoints | None = None
        if spec.state_checkpoints_mb and self.decodes and self.store is None:
            self.checkpoints = Checkpoints(spec.state_checkpoints_mb << 20)
            log.info("prefix reuse for %s from whole-state checkpoints: up to %d MiB in this worker", self.arch,
                     spec.state_checkpoints_mb)
        # reads the KV out of a state (the proofs, the prefix cache)
        self.fingerprint = fingerprint_from_gguf(self.model_path)
        # the libraries' and CPU's hash: the prefix cache's disk tier keeps only blocks of this build
        self.build = library_build() if self.store is not None else ""

        self.free_slots = self.max_seqs
        self.streams = StreamRun(self.max_seqs)  # a decoding sequence's KV stream: seq_id in the batch context
        self.waiting: deque[Sequence] = deque()
        self.active: dict[str, Sequence] = {}  # request_id -> sequence holding a seq_id
        self.queued: dict[str, Sequence] = {}  # request_id -> sequence waiting for a slot
        self.counters = {"prompt_tokens": 0, "generated_tokens": 0, "steps": 0, "finished": 0, "decode_errors": 0,
                         "stream_moves": 0, "cached_tokens": 0, "padded_steps": 0,
                         "guessed_tokens": 0, "kept_guesses": 0, "drafted_tokens": 0, "kept_drafts": 0}
        self._rate = TokenRate()
        log.info(
            "llama.cpp engine built: %s, n_ctx=%d per sequence, batch=%d seqs, chunk=%d, threads=%d, kernels %s",
            self.model_path.name, self.n_ctx, self.max_seqs, self.chunk, spec.threads, self.kernels.kernels,
        )

    def batch_params(self, n_batch: int):
        """The batch context's parameters, with room for n_batch tokens per llama_decode (the benches under bench/
        build twins of it with more room)."""
        return batch_params(self.spec, self.seq_ctx, self.max_seqs, n_batch)

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
            "state_checkpoints_mb": self.checkpoints.budget >> 20 if self.checkpoints is not None else 0,
            "repack": self.spec.repack,
            "kernels": self.kernels.kernels,
            "build": self.build,
            "kernels_why": self.kernels.why,
            "exact_resume_tokens": self.exact_resume,
            "attention": "tiled" if self.tiled_attention else "llama.cpp",
            "weight_types": list(self.weight_types),
            "exact_decode": self.exact_decode,
            "keeps_generated": self.keeps_generated,
            "lone_padding": self.pad_lone,
            "speculative_tokens": self.speculative_tokens if self.step_cost is not None else 0,
            "draft_model": self.draft.name if self.draft is not None and self.step_cost is not None else "",
        }

    def proofs(self) -> Proofs:
        return Proofs(self.exact_decode, self.exact_resume, self.pad_lone)

    def safer_kernels(self) -> tuple[dict, str]:
        if not self.kernels.safe_repack:
            return {}, ""
        return {"repack": self.kernels.safe_repack}, f"weight repacking ({self.kernels.kernels} kernels)"

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
        seq = Sequence(request=request, prompt=prompt, max_tokens=max_tokens, started=time.monotonic(),
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
        elif self.checkpoints is not None and seq.request.prompt_logprobs is None and handling.kv is None:
            # a state taken where the rest then runs in chunks that give a whole run's bits (the warm-up's proof)
            seq.checkpoint = self.checkpoints.find(prompt, 1 if self.exact_resume == 1 else self.chunk)
            seq.hit_tokens = seq.checkpoint.n_tokens if seq.checkpoint is not None else 0
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
        if self.draft is not None:
            self.draft.close()
            self.draft = None
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

    def _needs_slot(self, seq: Sequence) -> bool:
        """A sequence that decodes here holds a batch slot; a prompt that is only handed on (prefill role, or
        auto mode offloading its decode) runs in the prompt context alone and holds none."""
        return self.decodes and not seq.handling.handoff

    def _start(self, seq: Sequence) -> list:
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

    _add = staticmethod(add_row)  # the benches under bench/ fill batches with it too

    def _release(self, seq: Sequence) -> None:
        """Remove the sequence from the KV cache and give its slot back."""
        self.active.pop(seq.request.request_id, None)
        if self._unkept is not None and self._unkept[0] is seq:  # cancelled before its blocks were written:
            # the daemon let their slots go with the request (it may give them to another before this Cancel
            # arrives: a step between writes them there, and the reader's checksum and tokens tell it so)
            self._unkept = None
            llama_cpp.llama_memory_seq_rm(self.prefill_memory, 0, -1, -1)
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

    def _fail(self, rc: int, seqs: list, why: str = "") -> list:
        """llama.cpp refused a pass, or a sequence cannot go on (`why`): end those sequences with an error rather than
        guess."""
        self.counters["decode_errors"] += 1
        why = why or f"llama_decode failed ({rc})"
        log.error("%s; failing %d sequences", why, len(seqs))
        deltas = []
        for seq in seqs:
            self._release(seq)
            deltas.append(Delta(seq.request.request_id, "", 0, "error", why))
        return deltas
