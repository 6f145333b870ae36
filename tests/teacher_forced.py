"""Judges a cross-engine KV handoff teacher-forced: the decoder's own next-token distributions against an import's.

Free-running greedy text from two engines can part at the first token for reasons that
have nothing to do with the handoff, so both runs are fed the same tokens: the llama.cpp
decoder runs the prompt itself and greedily produces N tokens, keeping its distribution at
each step; then the other engine's record is imported into a fresh sequence of the same
context, the same tokens are fed, and the distributions are compared step by step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived",
    "The three primary colours are",
    "Q: What is the boiling point of water at sea level?\nA:",
    "<|im_start|>user\nWrite a haiku about autumn.<|im_end|>\n<|im_start|>assistant\n",
    "In 1969, Neil Armstrong became the first person to",
    "Photosynthesis is the process by which plants",
    "import numpy as np\n\nx = np.linspace(0, 1, 100)\ny =",
    "The best way to learn a new language is to " * 6,  # ~60 tokens: several vLLM blocks, a partial last one
]
N_TOKENS = 16  # greedy tokens per prompt: N - 1 compared steps, 150 over the 10 prompts
N_SEQ = 4  # the decode context's sequences (non-unified: one KV stream each), as a decode worker has


@pytest.fixture(scope="session")
def hf_folder(default_model):
    """The HF folder made from the q4_0 GGUF (`make test` makes it first; made here if missing)."""
    pytest.importorskip("transformers")
    from syshaxd.sdk.hf_model import ensure_hf_folder

    return ensure_hf_folder(default_model)


@dataclass
class Verdict:
    """Figures over every compared step of every prompt."""

    top1: list = field(default_factory=list)  # per step: the two argmaxes agree
    kl: list = field(default_factory=list)  # per step: KL(decoder's own || after import)

    def add(self, ref: np.ndarray, got: np.ndarray) -> None:
        for r, g in zip(ref, got):
            lr, lg = _log_softmax(r), _log_softmax(g)
            self.top1.append(int(np.argmax(r)) == int(np.argmax(g)))
            self.kl.append(float(np.sum(np.exp(lr) * (lr - lg))))

    @property
    def agreement(self) -> float:
        return float(np.mean(self.top1))

    @property
    def mean_kl(self) -> float:
        return float(np.mean(self.kl))

    @property
    def steps(self) -> int:
        return len(self.top1)

    def __str__(self) -> str:
        return f"top-1 agreement {self.agreement:.1%}, mean KL {self.mean_kl:.4f} over {self.steps} steps"


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


class Decoder:
    """A llama.cpp context made as a decode worker makes its own: f16 KV, flash attention, N_SEQ streams."""

    def __init__(self, gguf, n_ctx: int = 1024) -> None:
        import llama_cpp

        from syshax_llamacpp.codec import StateBuffer
        from syshaxd.sdk.gguf.header import fingerprint_from_gguf

        self.ll = llama_cpp
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(str(gguf).encode(), llama_cpp.llama_model_default_params())
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.fingerprint = fingerprint_from_gguf(gguf)
        p = llama_cpp.llama_context_default_params()
        p.n_ctx = n_ctx * N_SEQ
        p.n_batch = p.n_ubatch = 512
        p.n_seq_max = N_SEQ
        p.kv_unified = False
        p.flash_attn_type = 1  # as the engine: V not transposed
        p.n_threads = p.n_threads_batch = 1  # one thread spins on no one else's core (shared CI hosts)
        self.ctx = llama_cpp.llama_init_from_model(self.model, p)
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.batch = llama_cpp.llama_batch_init(512, 0, 1)
        self.scratch = StateBuffer()

    def tokenize(self, text: str) -> list[int]:
        data = text.encode()
        buf = (self.ll.llama_token * (len(data) + 8))()
        n = self.ll.llama_tokenize(self.vocab, data, len(data), buf, len(buf), True, True)
        return list(buf[:n])

    def _decode(self, tokens: list[int], start: int, seq: int) -> np.ndarray:
        while len(tokens) > 512:  # the batch's size
            self._decode(tokens[:512], start, seq)
            tokens, start = tokens[512:], start + 512
        b = self.batch
        b.n_tokens = len(tokens)
        for i, t in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, start + i, 1, i == len(tokens) - 1
            b.seq_id[i][0] = seq
        assert self.ll.llama_decode(self.ctx, b) == 0
        ptr = self.ll.llama_get_logits_ith(self.ctx, len(tokens) - 1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def reference(self, prompt: list[int], n: int = N_TOKENS) -> tuple[list[int], np.ndarray]:
        """The decoder's own greedy tokens, and its logits after feeding each but the last."""
        logits = self._decode(prompt, 0, 0)
        generated, seen = [int(np.argmax(logits))], []
        for i in range(n - 1):
            logits = self._decode([generated[-1]], len(prompt) + i, 0)
            seen.append(logits)
            generated.append(int(np.argmax(logits)))
        self.ll.llama_memory_seq_rm(self.memory, 0, -1, -1)
        return generated, np.stack(seen)

    def forced(self, record, generated: list[int]) -> np.ndarray:
        """Logits after importing the record into a fresh sequence and feeding the same tokens."""
        from syshax_llamacpp.codec import import_record

        seq = 1
        import_record(self.ctx, seq, record, v_trans=False, scratch=self.scratch, n_stream=N_SEQ)
        seen = [self._decode([t], record.n_tokens + i, seq) for i, t in enumerate(generated[:-1])]
        self.ll.llama_memory_seq_rm(self.memory, seq, -1, -1)
        return np.stack(seen)

    def close(self) -> None:
        self.ll.llama_batch_free(self.batch)
        self.ll.llama_free(self.ctx)
        self.ll.llama_model_free(self.model)


def without_permutation(data: bytes):
    """The record with K put back in HF order: the control, which must decode badly."""
    from syshaxd.sdk.kv.hf_codec import k_from_llama
    from syshaxd.sdk.kv.record import decode, seal

    buf = bytearray(data)
    rec = decode(buf)
    for layer in range(rec.fingerprint.n_layer):
        rec.k(layer)[:] = k_from_llama(rec.k(layer).copy(), rec.fingerprint)
    seal(buf)
    return decode(buf)


def judge(decoder: Decoder, record_bytes_for, prompts=PROMPTS) -> tuple[Verdict, Verdict]:
    """(with the codec's K permutation, with it left out) over the prompts.

    record_bytes_for(tokens) -> the bytes of the record the engine under test made for the prompt.
    """
    from syshaxd.sdk.kv.record import decode

    good, bad = Verdict(), Verdict()
    for text in prompts:
        tokens = decoder.tokenize(text)
        generated, ref = decoder.reference(tokens)
        data = record_bytes_for(tokens)
        record = decode(data, expect=decoder.fingerprint)
        assert record.tokens.tolist() == tokens and record.positions.tolist() == list(range(len(tokens)))
        good.add(ref, decoder.forced(record, generated))
        bad.add(ref, decoder.forced(without_permutation(data), generated))
    return good, bad
