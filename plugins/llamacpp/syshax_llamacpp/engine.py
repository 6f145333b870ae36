"""The llama.cpp CPU engine: up to max_batch_size sequences decoded per llama_decode, prompts run beside them.

LlamaCppEngine is the SDK's Engine: it loads the model (contexts.py), builds the objects that each own a part of
the engine's state, takes requests in (submit, cancel), says how it stands (info, stats) and frees it all (close):

* prompt_context.py (PromptContext): the prompt context, where prompts run a chunk at a time, alone;
* decode_batch.py (DecodeBatch): the batch context, its KV streams and each step's rows;
* slots.py (SlotTable): which sequences wait for a batch slot and which are active (sequence.py: their states);
* prefix_side.py (PrefixSide): the prefix cache's blocks (prefix.py) or whole-state checkpoints (checkpoints.py);
* handoff.py (Handoff, KVPort): a KV record in from a prefill engine, or out to a decoder;
* sampling.py (RowSampler): each sequence's sampler chain, and its next token;
* guessing.py (Guesser): speculative decoding's guesses and what it learns of them (drafting.py, draft_model.py);
* proofs.py (WarmUp): the warm-up, and what it proves of this llama.cpp build;
* stepping.py (Stepper): the step, which asks the others, and a sequence's life around it.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Callable
from pathlib import Path

import llama_cpp

from syshax_llamacpp.contexts import batch_params, load_model, prompt_params
from syshax_llamacpp.decode_batch import DecodeBatch
from syshax_llamacpp.draft_model import DraftModel
from syshax_llamacpp.guessing import Guesser
from syshax_llamacpp.handoff import Handoff, KVPort
from syshax_llamacpp.prefix_side import PrefixSide
from syshax_llamacpp.prompt_context import PromptContext
from syshax_llamacpp.proofs import Proved, WarmUp
from syshax_llamacpp.sampling import RowSampler, grammar_parses
from syshax_llamacpp.sequence import Sequence
from syshax_llamacpp.slots import SlotTable
from syshax_llamacpp.stepping import Stepper
from syshaxd.sdk.gguf.header import fingerprint_from_gguf
from syshaxd.sdk.gguf.quantize import weight_types
from syshaxd.sdk.gguf.vocab import Vocab
from syshaxd.sdk.prompt_fit import fit_prompt
from syshaxd.sdk.types import Accepted, EngineSpec, EngineStats, GenerateRequest, Handling, Proofs, Refusal, Rejected

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


class LlamaCppEngine:
    """Continuous batching: sequences join and leave the running batch at any step.

    A sequence enters decoding either by evaluating its prompt here (in the prompt context, in chunks of at most
    prefill_chunk_size per step, its KV then moved into a stream of the decode batch), or by having a prefill
    engine's KV record set into a stream and its first token given (handoff.py); the decode step does not care
    which.
    """

    def __init__(self, spec: EngineSpec, on_graph: Callable[[], None] | None = None) -> None:
        """on_graph (tests, diagnostics): called for every graph llama.cpp computes on the batch context -- once per
        ubatch -- through its eval callback, which costs a Python call per graph node."""
        self.spec = spec
        loaded = load_model(spec)
        self.model_path, self.model, self.kernels = loaded.path, loaded.model, loaded.kernels
        self.tiled_attention = loaded.tiled_attention
        self.attention_why = loaded.attention_why
        self.arch, self.shape = loaded.arch, loaded.state  # how a sequence's state is laid out
        self.weight_types = weight_types(self.model_path)  # what the kernels multiply: the proofs' warnings name them
        self.vocab = Vocab(model=self.model)  # tokenizing, chat template and pieces, as every engine does them
        self.n_vocab = self.vocab.n_vocab
        self.n_ctx_train = llama_cpp.llama_model_n_ctx_train(self.model)
        self.max_seqs = spec.max_batch_size
        self.chunk = spec.prefill_chunk_size
        self.n_ctx = min(spec.n_ctx, self.n_ctx_train)  # the most tokens one sequence may hold (prompt + completion)
        # the batch context decodes one token per sequence, or a lone sequence's and its guessed next ones
        # (speculative decoding: guessing.py says why only a lone one's); no more room than that: llama.cpp reserves
        # its compute buffer for the room (the default model: 1.6 MiB for 8 rows, 12.8 MiB for 64), though a step
        # takes no longer in a roomier context (bench/bench_verify_rows.py --room)
        speculative_tokens = spec.speculative_tokens if spec.role != "prefill" else 0
        if speculative_tokens and self.shape.recurrent:
            # a guess refused must leave the KV: a recurrent state holds every token in one cell and cannot drop the
            # last ones (llama_memory_seq_rm refuses a partial range)
            log.info("speculative decoding off: %s's recurrent state cannot drop a refused guess", self.arch)
            speculative_tokens = 0
        n_batch = max(self.max_seqs, 1 + speculative_tokens)
        if spec.guess_always:  # the tests' every guess of every sequence, checked
            n_batch = self.max_seqs * (1 + speculative_tokens)
        cparams = self.batch_params(n_batch)
        if on_graph is not None:
            self._eval_callback = _graph_observer(on_graph)  # kept: llama.cpp holds only the pointer
            cparams.cb_eval = self._eval_callback
        # a prefill-only worker hands every prompt on and never decodes: no batch context
        self.decode = (DecodeBatch(self.model, cparams, self.max_seqs, n_batch, self.n_vocab)
                       if spec.role != "prefill" else None)
        # prompts run alone, in a context of their own (contexts.prompt_params says why)
        self.prompt = PromptContext(self.model, prompt_params(spec, self.n_ctx, self.chunk, cparams.flash_attn_type),
                                    self.chunk, self.n_vocab)
        # guesses from a draft model rather than the sequence's own context (config draft_model)
        draft = None
        if spec.draft_model and speculative_tokens and self.decode is not None:
            draft = DraftModel(spec.draft_model, self.model, n_ctx=self.n_ctx, chunk=self.chunk,
                               threads=spec.threads, use_extra_bufts=self.kernels.use_extra_bufts)
        self.guesser = Guesser(speculative_tokens, draft, n_vocab=self.n_vocab, n_ctx=self.n_ctx,
                               guess_always=spec.guess_always)
        port = None
        if spec.ring:
            port = KVPort(spec.ring, str(self.model_path), n_stream=self.max_seqs, timeout=spec.handoff_timeout,
                          whole_state=loaded.whole_state, shape=self.shape)
        self.handoff = Handoff(port, self.prompt, self.decode)
        self.prefix = PrefixSide(spec, self.prompt, fingerprint_from_gguf(self.model_path), arch=self.arch,
                                 shape=self.shape, sliding_window=loaded.sliding_window,
                                 decodes=self.decode is not None)
        self.sampler = RowSampler(self.n_vocab, self.vocab.vocab)
        self.slots = SlotTable(self.max_seqs)
        self.stepper = Stepper(self.slots, self.prompt, self.decode, prefix=self.prefix, handoff=self.handoff,
                               sampler=self.sampler, guesser=self.guesser, vocab=self.vocab, shape=self.shape)
        # proved at the warm-up that a decode step gives a token the bits a prompt chunk of any size gives it
        # (proofs.WarmUp._proves_decode_kv; a prefill-only worker: that chunks of any size do): a resume, a handoff
        # from another such worker and a prefix hit then give the undisturbed run's tokens
        self.exact_decode = False
        log.info(
            "llama.cpp engine built: %s, n_ctx=%d per sequence, batch=%d seqs, chunk=%d, threads=%d, kernels %s",
            self.model_path.name, self.n_ctx, self.max_seqs, self.chunk, spec.threads, self.kernels.kernels,
        )

    def batch_params(self, n_batch: int):
        """The batch context's parameters, with room for n_batch tokens per llama_decode (the benches under bench/
        build twins of it with more room)."""
        return batch_params(self.spec, self.n_ctx, self.max_seqs, n_batch)

    def warm_up(self) -> None:
        """Run what serving runs and prove what this build gives (proofs.WarmUp); each owner hears what concerns
        it."""
        proved: Proved = WarmUp(self.spec, self.prompt, self.decode, seq_ctx=self.n_ctx, shape=self.shape,
                                weight_types=tuple(self.weight_types), tiled_attention=self.tiled_attention,
                                prefix_cache=self.prefix.store is not None,
                                speculative_tokens=self.guesser.speculative_tokens).run()
        self.exact_decode = proved.exact_decode
        if self.decode is not None:
            self.decode.proved(proved.pad_lone)
        self.prefix.proved(proved.exact_resume, proved.keeps_generated)
        if self.guesser.speculative_tokens and self.decode is not None:
            self.guesser.proved(proved.step_cost, list(proved.warm_tokens))

    # --- Engine protocol ------------------------------------------------------------------

    def info(self) -> dict:
        checkpoints = self.prefix.checkpoints
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
            "prefix_cache": self.prefix.store is not None,
            "state_checkpoints_mb": checkpoints.budget >> 20 if checkpoints is not None else 0,
            "repack": self.spec.repack,
            "kernels": self.kernels.kernels,
            "build": self.prefix.build,
            "kernels_why": self.kernels.why,
            "exact_resume_tokens": self.prefix.exact_resume,
            "attention": "tiled" if self.tiled_attention else "llama.cpp",
            "attention_why": self.attention_why,
            "weight_types": list(self.weight_types),
            "exact_decode": self.exact_decode,
            "keeps_generated": self.prefix.keeps_generated,
            "lone_padding": self._pad_lone,
            "speculative_tokens": self.guesser.speculative_tokens if self.guesser.speculating else 0,
            "draft_model": self.guesser.draft.name if self.guesser.draft is not None and self.guesser.speculating
            else "",
        }

    @property
    def _pad_lone(self) -> bool:
        return self.decode is not None and self.decode.pad_lone

    def proofs(self) -> Proofs:
        return Proofs(self.exact_decode, self.prefix.exact_resume, self._pad_lone)

    def safer_kernels(self) -> tuple[dict, str]:
        if not self.kernels.safe_repack:
            return {}, ""
        return {"repack": self.kernels.safe_repack}, f"weight repacking ({self.kernels.kernels} kernels)"

    def submit(self, request: GenerateRequest, handling: Handling = Handling()) -> list:
        rid = request.request_id
        if handling.handoff and self.handoff.port is None:
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
                       handling=handling, decodes_here=self.decode is not None and not handling.handoff)
        self.prefix.look_up(seq)
        return [Accepted(rid, len(prompt), max_tokens, cached_tokens=seq.hit_tokens), *self.stepper.admit(seq)]

    def cancel(self, request_id: str) -> list:
        return self.stepper.cancel(request_id)

    def has_work(self) -> bool:
        return self.slots.has_work()

    def step(self) -> list:
        return self.stepper.step()

    def stats(self) -> EngineStats:
        decode_counts = self.decode.counters if self.decode is not None else {}
        return EngineStats(running=len(self.slots.active), waiting=len(self.slots.waiting),
                           free_slots=self.slots.free_slots, max_batch_size=self.max_seqs, n_ctx=self.n_ctx,
                           kv_usage=self.slots.kv_tokens() / (self.n_ctx * self.max_seqs),
                           tokens_per_second=self.stepper.rate.per_second(), **self.stepper.counters,
                           **decode_counts, **self.prefix.counters, **self.guesser.counters)

    def close(self) -> None:
        for seq in list(self.slots.active.values()):
            self.stepper.release(seq)
        self.handoff.close()
        self.prefix.close()
        self.guesser.close()
        if self.decode is not None:
            self.decode.close()
        self.prompt.close()
        if self.model is not None:
            llama_cpp.llama_model_free(self.model)
            self.model = None
