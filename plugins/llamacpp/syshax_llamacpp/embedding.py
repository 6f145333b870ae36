"""An embedding model's engine: a pooled vector per input, computed by llama.cpp one input a pass, the inputs of
every request waiting taken in turn.

The model's own pooling (its GGUF's pooling_type: mean, CLS, last token) makes one vector of each input, as
llama-server's /v1/embeddings does; a model without one is a chat model, which the daemon refuses as an embedding
model before it gets here. A reranker (pooling "rank": Qwen3-Reranker, or a cross-encoder such as bge-reranker,
whose file has no pooling type and which the daemon names one in EngineSpec.pooling, as llama-server's --reranking
does) gives its classifier's scores of a query and a document instead, each pair one input, written as
llama-server's /v1/rerank writes it (_pair_tokens).

One input a pass, because then an input's vector is the same whatever else is asked at the same time: several
inputs in one pass multiply hundreds of rows at once, and llama.cpp's matrix kernels sum a row in another order
at other row counts (measured at Qwen3-Embedding-0.6B's shape in Q8_0: 8 inputs of 40 to 160 tokens in one pass
moved a vector by 1.7 % of its length, cosine 0.99985, in one KV cache or in a stream each). On a CPU a pass of
one input of that size already keeps the cores busy: the 8 inputs took 4.0 to 4.3 s together and 4.2 s one by
one (bench/bench_embedding_batch.py), and llama-server with 8 slots gives no more embeddings a second than one at
a time (bench/bench_embeddings.py).
Requests take turns input by input, so a short request is not held behind a long one.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections import deque
from dataclasses import dataclass

import llama_cpp
import numpy as np

from syshax_llamacpp import kernels
from syshaxd.sdk.types import Embedded, EmbedRequest, EngineSpec, EngineStats, Refusal, Rejected

log = logging.getLogger("syshax_llamacpp.embedding")

POOLING = {llama_cpp.LLAMA_POOLING_TYPE_MEAN: "mean", llama_cpp.LLAMA_POOLING_TYPE_CLS: "cls",
           llama_cpp.LLAMA_POOLING_TYPE_LAST: "last", llama_cpp.LLAMA_POOLING_TYPE_RANK: "rank"}
RATE_WINDOW = 5.0  # seconds of passes the tokens_per_second stat averages

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
    many tokens it is over), `step` runs one input of the request whose turn it is (a reranker's: one document
    beside the query)."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        llama_cpp.llama_backend_init()
        flags = kernels.read_cpu_flags()
        try:
            extra = kernels.extra_buffer_types()
        except (OSError, AttributeError):
            extra = None
        self.kernels = kernels.choose(spec.repack, extra, flags)
        mparams = llama_cpp.llama_model_default_params()
        mparams.use_extra_bufts = self.kernels.use_extra_bufts
        self.model = llama_cpp.llama_model_load_from_file(spec.model_path.encode(), mparams)
        if self.model is None:
            raise RuntimeError(f"llama.cpp could not load {spec.model_path}")
        self.arch = _meta(self.model, "general.architecture")
        self.n_embd = llama_cpp.llama_model_n_embd(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.trained = llama_cpp.llama_model_n_ctx_train(self.model)
        self.n_ctx = min(spec.n_ctx, self.trained) if spec.n_ctx > 0 else self.trained  # tokens an input may hold
        cparams = llama_cpp.llama_context_default_params()
        # one ubatch holds a whole input: a non-causal model (BERT, EmbeddingGemma) attends over all of it at once,
        # and llama.cpp pools each ubatch on its own, so a mean- or CLS-pooled input split in two would get the
        # vector of its last part
        cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = self.n_ctx
        cparams.n_seq_max = 1
        cparams.flash_attn_type = 1
        cparams.embeddings = True
        if spec.pooling == "rank":  # the daemon's reading: a cross-encoder's file has no pooling type to say it
            cparams.pooling_type = llama_cpp.LLAMA_POOLING_TYPE_RANK
        cparams.n_threads = cparams.n_threads_batch = spec.threads
        cparams.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(self.model, cparams)
        if self.ctx is None:
            llama_cpp.llama_model_free(self.model)
            raise RuntimeError(f"llama.cpp could not make a context for {spec.model_path} (n_ctx {self.n_ctx})")
        self.pooling = POOLING.get(llama_cpp.llama_pooling_type(self.ctx), "")
        if not self.pooling:
            self.close()
            raise RuntimeError(f"{spec.model_path} has no pooling type (mean, CLS, last token or rank): it is not "
                               "an embedding model or a reranker")
        self.reranker = self.pooling == "rank"
        # what a pass gives: a vector, or a reranker's n_cls_out scores (llama.cpp's "rank" pooling)
        self.n_out = llama_cpp.llama_model_n_cls_out(self.model) if self.reranker else self.n_embd
        template = llama_cpp.llama_model_chat_template(self.model, b"rerank") if self.reranker else None
        self.rerank_template = template.decode("utf-8", "replace") if template else ""
        self.batch = llama_cpp.llama_batch_init(self.n_ctx, 0, 1)
        self.queue: deque[_Pending] = deque()
        self._inputs = self._tokens = self._passes = self._finished = 0
        self._rate: deque[tuple[float, int]] = deque()  # (when, tokens) of the last RATE_WINDOW seconds' passes

    # --- the SDK's Engine -------------------------------------------------------------------

    def info(self) -> dict:
        return {"model_name": self.spec.model_name, "n_ctx": self.n_ctx, "max_batch_size": 1,
                "n_embd": self.n_embd, "pooling": self.pooling, "arch": self.arch, "n_out": self.n_out,
                "kernels": self.kernels.kernels, "kernels_why": self.kernels.why}

    def submit(self, request, handling=None) -> list:
        what = ("a reranker: it scores documents against a query (POST /v1/rerank)" if self.reranker
                else "an embedding model: it makes vectors (POST /v1/embeddings)")
        return [Rejected(request.request_id, Refusal.INVALID, f"{self.spec.model_name} is {what}, not text",
                         code="model_not_supported", param="model")]

    def embed(self, request: EmbedRequest) -> list:
        reranking = request.query is not None
        if reranking != self.reranker:  # the daemon sends each kind of request to its kind of model; never here
            why = (f"{self.spec.model_name} is a reranker: it scores documents against a query (POST /v1/rerank)"
                   if self.reranker else f"{self.spec.model_name} makes vectors (POST /v1/embeddings); it is no "
                   "reranker")
            return [Rejected(request.request_id, Refusal.INVALID, why, code="model_not_supported", param="model")]
        param = "documents" if reranking else "input"
        tokens: list[list[int]] = []
        try:
            if reranking:  # a query over the limit alone is the query's fault, not its first document's
                alone = len(self._pair_tokens(str(request.query), ""))
                if alone > self.n_ctx:
                    return [Rejected(request.request_id, Refusal.INVALID, f"query has {alone} tokens with the "
                                     f"model's prompt around it, over the {self.n_ctx} a query and a document may "
                                     "hold together here; shorten the query", code="context_length_exceeded",
                                     param="query")]
            for i, item in enumerate(request.inputs):
                if reranking:
                    ids = self._pair_tokens(str(request.query), str(item))
                else:
                    ids = self._tokenize(item) if isinstance(item, str) else list(item)
                why = self._refusal(i, ids, isinstance(item, str), len(request.inputs), param)
                if why:
                    return [Rejected(request.request_id, Refusal.INVALID, why, code="context_length_exceeded"
                                     if "over" in why else "invalid_value", param=param)]
                tokens.append(ids)
        except UnicodeEncodeError as exc:  # the API refuses such text first; a worker never dies of it
            return [Rejected(request.request_id, Refusal.INVALID, f"a text is not valid Unicode ({exc.reason}); "
                             "send valid UTF-8", param=param)]
        self.queue.append(_Pending(request.request_id, tokens, request.normalize and not reranking,
                                   [None] * len(tokens)))
        return []

    def cancel(self, request_id: str) -> list:
        self.queue = deque(p for p in self.queue if p.request_id != request_id)
        return []

    def has_work(self) -> bool:
        return bool(self.queue)

    def step(self) -> list:
        """One pass: the next input of the request at the head of the queue, which then goes to the back (requests
        take turns); the request, when that was its last input."""
        pending = self.queue.popleft()
        index = pending.next_input
        ids = pending.tokens[index]
        b = self.batch
        b.n_tokens = 0
        for pos, token in enumerate(ids):
            b.token[pos], b.pos[pos], b.n_seq_id[pos], b.logits[pos] = token, pos, 1, True
            b.seq_id[pos][0] = 0
        b.n_tokens = len(ids)
        started = time.monotonic()
        memory = llama_cpp.llama_get_memory(self.ctx)
        if memory:  # the last pass's KV goes (a non-causal model, BERT, keeps none)
            llama_cpp.llama_memory_clear(memory, True)
        if llama_cpp.llama_decode(self.ctx, b) != 0:
            return self._failed(pending, f"llama_decode failed on an input of {len(ids)} tokens")
        ptr = llama_cpp.llama_get_embeddings_seq(self.ctx, 0)
        if not ptr:
            return self._failed(pending, "llama.cpp gave no pooled vector")
        vector = np.ctypeslib.as_array(ptr, shape=(self.n_out,)).astype("<f4")
        if pending.normalize:
            norm = float(np.linalg.norm(vector))
            vector = vector / norm if norm > 0 else vector
        pending.vectors[index] = vector.astype("<f4").tobytes()
        pending.next_input += 1
        self._passes += 1
        self._inputs += 1
        self._tokens += len(ids)
        self._rate.append((started, len(ids)))
        while self._rate and started - self._rate[0][0] > RATE_WINDOW:
            self._rate.popleft()
        if pending.next_input < len(pending.tokens):
            self.queue.append(pending)
            return []
        self._finished += 1
        return [Embedded(pending.request_id, tuple(v for v in pending.vectors if v is not None),
                         sum(len(t) for t in pending.tokens))]

    def stats(self) -> EngineStats:
        now = time.monotonic()
        rate = sum(n for t, n in self._rate if now - t < RATE_WINDOW) / RATE_WINDOW
        return EngineStats(running=1 if self.queue else 0,
                           waiting=sum(len(p.tokens) - p.next_input for p in self.queue) - (1 if self.queue else 0),
                           free_slots=0 if self.queue else 1, max_batch_size=1, n_ctx=self.n_ctx,
                           tokens_per_second=rate, prompt_tokens=self._tokens, steps=self._passes,
                           finished=self._finished)

    def warm_up(self) -> None:
        """A short input and one of n_ctx tokens (the largest pass): kernels that crash here, or a pass that does not
        fit in memory, fail before the worker says ready."""
        token = 0 if self.n_vocab <= 1 else 1
        tokens = [[token] * min(self.n_ctx, 8), [token] * self.n_ctx]  # queued as they are, a reranker's too
        self.queue.append(_Pending("warm-up", tokens, False, [None] * len(tokens)))
        while self.queue:
            for event in self.step():
                if isinstance(event, Rejected):
                    raise RuntimeError(event.message)
        self._inputs = self._tokens = self._passes = self._finished = 0  # the stats count requests only
        self._rate.clear()

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

    def _tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """The text's tokens as llama-server tokenizes an embedding input: the model's BOS/EOS added (unless
        add_special is False), and special tokens written in the text read as such (Qwen3-Embedding asks for its
        <|endoftext|> at the end; unless parse_special is False)."""
        data = text.encode("utf-8")
        vocab = llama_cpp.llama_model_get_vocab(self.model)
        room = len(data) + 8
        buf = (llama_cpp.llama_token * room)()
        n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, room, add_special, parse_special)
        if n < 0:  # never with a byte a token at most, but llama.cpp says how many it needs
            room = -n
            buf = (llama_cpp.llama_token * room)()
            n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, room, add_special, parse_special)
        return list(buf[:n])

    def _pair_tokens(self, query: str, document: str) -> list[int]:
        """A reranker's input, as llama-server writes it (format_prompt_rerank): the model's "rerank" template with
        {query} and {document} filled in, its special tokens read as such; else BOS, the query, EOS, SEP, the
        document, EOS, each where the vocabulary adds it (a cross-encoder's [CLS] query [SEP] document [SEP])."""
        if self.rerank_template:  # (an empty template is none: llama-server would score the empty prompt)
            prompt = self.rerank_template.replace("{query}", query).replace("{document}", document)
            return self._tokenize(prompt, add_special=False)
        vocab = llama_cpp.llama_model_get_vocab(self.model)
        eos = llama_cpp.llama_vocab_eos(vocab)
        if eos == llama_cpp.LLAMA_TOKEN_NULL:
            eos = llama_cpp.llama_vocab_sep(vocab)
        add_eos = llama_cpp.llama_vocab_get_add_eos(vocab)
        ids = [llama_cpp.llama_vocab_bos(vocab)] if llama_cpp.llama_vocab_get_add_bos(vocab) else []
        # the texts' own special-token text stays text here, as llama-server tokenizes them (a document holding
        # "[SEP]" does not cut the pair)
        ids += self._tokenize(query, add_special=False, parse_special=False) + ([eos] if add_eos else [])
        ids += [llama_cpp.llama_vocab_sep(vocab)] if llama_cpp.llama_vocab_get_add_sep(vocab) else []
        return ids + self._tokenize(document, add_special=False, parse_special=False) + ([eos] if add_eos else [])

    def _refusal(self, index: int, ids: list[int], text: bool, count: int, param: str = "input") -> str:
        where = f"{param}[{index}]" if count > 1 or param == "documents" else param
        what = "with the query and the model's prompt around it, " if param == "documents" else ""
        if not ids:
            return f"{where} is empty{' after tokenization' if text else ''}; send at least one token"
        if len(ids) > self.n_ctx:
            more = (f"; the n_ctx of its [[models]] entry raises that up to the model's {self.trained}"
                    if self.n_ctx < self.trained else "")
            return (f"{where} has {len(ids)} tokens, {what}{len(ids) - self.n_ctx} over the {self.n_ctx} an input "
                    f"may hold here; shorten or split it{more}")
        bad = next((t for t in ids if not 0 <= t < self.n_vocab), None)
        if bad is not None:
            return f"{where} holds token id {bad}, which this model's vocabulary (0 to {self.n_vocab - 1}) has not"
        return ""

    def _failed(self, pending: _Pending, why: str) -> list:
        """The request whose pass failed ends with the reason; the others keep their turns."""
        log.error("%s: %s", pending.request_id, why)
        return [Rejected(pending.request_id, Refusal.FAILED, why)]
