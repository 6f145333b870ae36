"""An embedding model's engine: a pooled vector per input, computed by llama.cpp, inputs of every request queued
since the last step run together in one pass.

The model's own pooling (its GGUF's pooling_type: mean, CLS, last token) makes one vector of each input, as
llama-server's /v1/embeddings does; a model without one is a chat model, which the daemon refuses as an embedding
model before it gets here. Inputs share a pass as separate sequences, each in a KV stream of its own, so an input gets the same vector
alone and beside others (tests/test_embeddings.py compares); the streams cost n_ctx x batch KV cells.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections import deque
from dataclasses import dataclass

import llama_cpp
import numpy as np

from syshax_llamacpp import kernels
from syshax_llamacpp.contexts import ONE_KERNEL_PER_TYPE
from syshaxd.sdk.types import Embedded, EmbedRequest, EngineSpec, EngineStats, Refusal, Rejected

log = logging.getLogger("syshax_llamacpp.embedding")

POOLING = {llama_cpp.LLAMA_POOLING_TYPE_MEAN: "mean", llama_cpp.LLAMA_POOLING_TYPE_CLS: "cls",
           llama_cpp.LLAMA_POOLING_TYPE_LAST: "last"}
MAX_SEQUENCES = 64  # inputs in one pass at most (llama.cpp allows 256 sequences; beyond 64 a pass gains nothing)
CAUSAL_UBATCH = 512  # a causal model's inputs are split in ubatches of this many tokens (KV cache between them)


def _meta(model, key: str) -> str:
    buf = ctypes.create_string_buffer(64)
    n = llama_cpp.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return buf.value.decode("utf-8", "replace") if n > 0 else ""


@dataclass
class _Pending:
    """A request's inputs as tokens, and its vectors as they are computed."""

    request_id: str
    tokens: list[list[int]]
    normalize: bool
    vectors: list[bytes | None]
    next_input: int = 0  # the first input not yet in a pass

    @property
    def done(self) -> bool:
        return all(v is not None for v in self.vectors)


class LlamaCppEmbedder:
    """The SDK's Engine for Role.EMBED: `embed` queues a request (or refuses it at once, naming the input and by how
    many tokens it is over), `step` runs one pass over what is queued, in arrival order."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        llama_cpp.llama_backend_init()
        flags = kernels.read_cpu_flags()
        try:
            extra = kernels.extra_buffer_types()
        except (OSError, AttributeError):
            extra = None
        self.kernels = kernels.choose(spec.repack, extra, flags)
        os.environ.update(ONE_KERNEL_PER_TYPE)  # a row's bits whatever number of rows shares its pass
        mparams = llama_cpp.llama_model_default_params()
        mparams.use_extra_bufts = self.kernels.use_extra_bufts
        self.model = llama_cpp.llama_model_load_from_file(spec.model_path.encode(), mparams)
        if self.model is None:
            raise RuntimeError(f"llama.cpp could not load {spec.model_path}")
        self.arch = _meta(self.model, "general.architecture")
        self.causal = _meta(self.model, f"{self.arch}.attention.causal") != "false"
        self.n_embd = llama_cpp.llama_model_n_embd(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.trained = llama_cpp.llama_model_n_ctx_train(self.model)
        self.n_ctx = min(spec.n_ctx, self.trained) if spec.n_ctx > 0 else self.trained  # tokens an input may hold
        self.max_seqs = max(1, min(spec.max_batch_size, MAX_SEQUENCES))
        # One KV stream per sequence of a pass, as the chat engine's slots: in one cache the sequences share, an
        # input's attention sums over the others' cells too and its vector moves in the last bits with its
        # neighbours (measured: up to 4e-3 apart at 8 inputs); in streams of its own it is the same alone and
        # beside any others. A non-causal model (BERT) attends over a whole input at once: one ubatch holds it.
        self.n_batch = self.n_ctx * self.max_seqs
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = self.n_batch
        cparams.n_batch = self.n_batch
        cparams.n_ubatch = min(CAUSAL_UBATCH, self.n_batch) if self.causal else self.n_ctx
        cparams.n_seq_max = self.max_seqs
        cparams.kv_unified = False
        cparams.flash_attn_type = 1  # a sequence's own cells, in order
        cparams.embeddings = True
        cparams.n_threads = cparams.n_threads_batch = spec.threads
        cparams.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(self.model, cparams)
        if self.ctx is None:
            llama_cpp.llama_model_free(self.model)
            raise RuntimeError(f"llama.cpp could not make a context for {spec.model_path} (n_ctx {self.n_batch})")
        self.pooling = POOLING.get(llama_cpp.llama_pooling_type(self.ctx), "")
        if not self.pooling:
            self.close()
            raise RuntimeError(f"{spec.model_path} has no pooling type (mean, CLS or last token): it is not an "
                               "embedding model")
        self.batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self.queue: deque[_Pending] = deque()
        self._inputs = self._tokens = self._passes = self._finished = 0
        self._rate: deque[tuple[float, int]] = deque(maxlen=32)

    # --- the SDK's Engine -------------------------------------------------------------------

    def info(self) -> dict:
        return {"model_name": self.spec.model_name, "n_ctx": self.n_ctx, "max_batch_size": self.max_seqs,
                "n_embd": self.n_embd, "pooling": self.pooling, "causal": self.causal, "arch": self.arch,
                "kernels": self.kernels.kernels, "kernels_why": self.kernels.why}

    def submit(self, request, handling=None) -> list:
        return [Rejected(request.request_id, Refusal.INVALID, f"{self.spec.model_name} is an embedding model: it "
                         "makes vectors (POST /v1/embeddings), not text", code="model_not_supported", param="model")]

    def embed(self, request: EmbedRequest) -> list:
        tokens: list[list[int]] = []
        for i, item in enumerate(request.inputs):
            ids = self._tokenize(item) if isinstance(item, str) else list(item)
            why = self._refusal(i, ids, isinstance(item, str), len(request.inputs))
            if why:
                return [Rejected(request.request_id, Refusal.INVALID, why, code="context_length_exceeded"
                                 if "over" in why else "invalid_value", param="input")]
            tokens.append(ids)
        self.queue.append(_Pending(request.request_id, tokens, request.normalize, [None] * len(tokens)))
        return []

    def cancel(self, request_id: str) -> list:
        self.queue = deque(p for p in self.queue if p.request_id != request_id)
        return []

    def has_work(self) -> bool:
        return bool(self.queue)

    def step(self) -> list:
        """One pass: inputs in arrival order while they fit (tokens and sequences); the requests it completes."""
        taken: list[tuple[_Pending, int]] = []  # (request, its input) per sequence of the pass
        n_tokens = 0
        b = self.batch
        b.n_tokens = 0
        full = False
        for pending in self.queue:
            while pending.next_input < len(pending.tokens):
                ids = pending.tokens[pending.next_input]
                if len(taken) == self.max_seqs or n_tokens + len(ids) > self.n_batch:
                    full = True
                    break
                for pos, token in enumerate(ids):
                    i = b.n_tokens
                    b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, True
                    b.seq_id[i][0] = len(taken)
                    b.n_tokens = i + 1
                taken.append((pending, pending.next_input))
                pending.next_input += 1
                n_tokens += len(ids)
            if full:
                break
        started = time.monotonic()
        memory = llama_cpp.llama_get_memory(self.ctx)
        if memory:  # the last pass's KV goes (a non-causal model, BERT, keeps none)
            llama_cpp.llama_memory_clear(memory, True)
        if llama_cpp.llama_decode(self.ctx, b) != 0:
            return self._fail_all(f"llama_decode failed on a pass of {len(taken)} inputs ({n_tokens} tokens)")
        for seq, (pending, index) in enumerate(taken):
            ptr = llama_cpp.llama_get_embeddings_seq(self.ctx, seq)
            if not ptr:
                return self._fail_all("llama.cpp gave no pooled vector")
            vector = np.ctypeslib.as_array(ptr, shape=(self.n_embd,)).astype("<f4")
            if pending.normalize:
                norm = float(np.linalg.norm(vector))
                vector = vector / norm if norm > 0 else vector
            pending.vectors[index] = vector.astype("<f4").tobytes()
        self._passes += 1
        self._inputs += len(taken)
        self._tokens += n_tokens
        self._rate.append((started, n_tokens))
        done = [p for p in self.queue if p.done]  # a short request behind a long one may be done first
        for pending in done:
            self.queue.remove(pending)
        self._finished += len(done)
        return [Embedded(p.request_id, tuple(v for v in p.vectors if v is not None), sum(len(t) for t in p.tokens))
                for p in done]

    def stats(self) -> EngineStats:
        now = time.monotonic()
        recent = [(t, n) for t, n in self._rate if now - t < 5.0]
        rate = sum(n for _, n in recent) / 5.0 if recent else 0.0
        return EngineStats(running=0, waiting=sum(len(p.tokens) - p.next_input for p in self.queue),
                           free_slots=self.max_seqs, max_batch_size=self.max_seqs, n_ctx=self.n_ctx,
                           tokens_per_second=rate, prompt_tokens=self._tokens, steps=self._passes,
                           finished=self._finished)

    def warm_up(self) -> None:
        """A pass of every sequence, and a full ubatch of one: kernels that crash here crash before the worker says
        ready."""
        token = 0 if self.n_vocab <= 1 else 1
        self.embed(EmbedRequest("warm-up", tuple((token,) * min(self.n_ctx, 32) for _ in range(self.max_seqs))))
        full = self.n_ctx if not self.causal else min(self.n_ctx, CAUSAL_UBATCH)
        self.embed(EmbedRequest("warm-up-long", ((token,) * full,)))
        while self.queue:
            for event in self.step():
                if isinstance(event, Rejected):
                    raise RuntimeError(event.message)

    def close(self) -> None:
        if getattr(self, "batch", None) is not None:
            llama_cpp.llama_batch_free(self.batch)
            self.batch = None
        if getattr(self, "ctx", None) is not None:
            llama_cpp.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None) is not None:
            llama_cpp.llama_model_free(self.model)
            self.model = None

    # --- inputs -----------------------------------------------------------------------------

    def _tokenize(self, text: str) -> list[int]:
        """The text's tokens as llama-server tokenizes an embedding input: the model's BOS/EOS added, special
        tokens' texts left as text."""
        data = text.encode("utf-8")
        vocab = llama_cpp.llama_model_get_vocab(self.model)
        room = len(data) + 8
        buf = (llama_cpp.llama_token * room)()
        n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, room, True, False)
        if n < 0:  # never with a byte a token at most, but llama.cpp says how many it needs
            room = -n
            buf = (llama_cpp.llama_token * room)()
            n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, room, True, False)
        return list(buf[:n])

    def _refusal(self, index: int, ids: list[int], text: bool, count: int) -> str:
        where = f"input[{index}]" if count > 1 else "input"
        if not ids:
            return f"{where} is empty{' after tokenization' if text else ''}; send at least one token"
        if len(ids) > self.n_ctx:
            more = (f"; the n_ctx of its [[models]] entry raises that up to the model's {self.trained}"
                    if self.n_ctx < self.trained else "")
            return (f"{where} has {len(ids)} tokens, {len(ids) - self.n_ctx} over the {self.n_ctx} an input may hold "
                    f"here; shorten or split it{more}")
        bad = next((t for t in ids if not 0 <= t < self.n_vocab), None)
        if bad is not None:
            return f"{where} holds token id {bad}, which this model's vocabulary (0 to {self.n_vocab - 1}) has not"
        return ""

    def _fail_all(self, why: str) -> list:
        log.error("%s", why)
        out = [Rejected(p.request_id, Refusal.FAILED, why) for p in self.queue]
        self.queue.clear()
        return out
