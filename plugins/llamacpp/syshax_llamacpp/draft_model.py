"""A draft model: a smaller model of the served model's vocabulary that guesses a lone sequence's next tokens.

Prompt lookup (drafting.PromptLookup) guesses only what the sequence's own context holds. A draft model (config
draft_model: Qwen2.5-0.5B beside Qwen2.5-7B, say) guesses any text, greedily, one llama_decode of its own per
token; the served model checks the guess in its step exactly as it checks a lookup's (stepping.Stepper._check), so the
text is the one it gives without a guess. It pays where a guessed row of the served model costs far less than a
step and the draft's own steps less still: drafting.best_guess weighs both, as they are timed, against the
lookup's guess.

The draft's context holds one sequence: the tokens it last drafted from. Before each guess the tokens it holds are
compared with the sequence's (prompt, generated, next): the KV after the first difference is dropped (the guessed
tokens the check refused, or another request's) and the rest is fed, in chunks. So it follows the lone sequence
from step to step at one row a drafted token, and catches up a new one (its prompt) once: that catch-up is not
weighed in the step's choice (a draft is far cheaper than the model, or it does not pay at all).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import llama_cpp
import numpy as np

from syshax_llamacpp.contexts import add_row, free_context

log = logging.getLogger("syshax_llamacpp.engine")

# llama-server's own bound (common/speculative.cpp): vocabularies of one family differ in padding rows only
MAX_VOCAB_DIFFERENCE = 128


class DraftModelError(RuntimeError):
    """The draft model cannot guess for the served model: it does not load, or its vocabulary is another."""


def _text(vocab, token: int) -> bytes:
    return llama_cpp.llama_vocab_get_text(vocab, token) or b""


def vocabulary_difference(main_vocab, draft_vocab) -> str:
    """Why a draft model's guesses could not be the served model's tokens (after llama-server's checks: the tokenizer
    type, BOS and EOS, the size within MAX_VOCAB_DIFFERENCE rows; and every shared token's text, where it skips the
    first 5); "" when they can. A token the draft has not (its vocabulary may be the smaller) ends a guess."""
    n_main, n_draft = llama_cpp.llama_vocab_n_tokens(main_vocab), llama_cpp.llama_vocab_n_tokens(draft_vocab)
    if llama_cpp.llama_vocab_type(main_vocab) != llama_cpp.llama_vocab_type(draft_vocab):
        return "its tokenizer is of another type"
    if abs(n_main - n_draft) > MAX_VOCAB_DIFFERENCE:
        return f"its vocabulary has {n_draft} tokens, the model's {n_main}"
    for name, get in (("BOS", llama_cpp.llama_vocab_bos), ("EOS", llama_cpp.llama_vocab_eos)):
        if get(main_vocab) != get(draft_vocab):
            return f"its {name} token is {get(draft_vocab)}, the model's {get(main_vocab)}"
    for token in range(min(n_main, n_draft)):
        if _text(main_vocab, token) != _text(draft_vocab, token):
            return (f"token {token} is {_text(draft_vocab, token)!r} in it and {_text(main_vocab, token)!r} in the "
                    "model")
    return ""


class DraftModel:
    """The draft model, its one-sequence context, and what one drafted token costs (a moving average)."""

    def __init__(self, path: str | Path, main_model, *, n_ctx: int, chunk: int, threads: int,
                 use_extra_bufts: bool) -> None:
        path = Path(path)
        mparams = llama_cpp.llama_model_default_params()
        mparams.use_extra_bufts = use_extra_bufts  # the served model's kernels (kernels.choose)
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
        if self.model is None:
            raise DraftModelError(f"draft_model: llama.cpp could not load {path}; give a GGUF file")
        self.ctx = None
        try:
            if llama_cpp.llama_model_is_recurrent(self.model) or llama_cpp.llama_model_is_hybrid(self.model):
                raise DraftModelError(f"draft_model: {path.name} is a recurrent model, whose state cannot drop the "
                                      "refused guesses; take a transformer of the model's family")
            why = vocabulary_difference(llama_cpp.llama_model_get_vocab(main_model),
                                        llama_cpp.llama_model_get_vocab(self.model))
            if why:
                raise DraftModelError(f"draft_model: {path.name} cannot guess this model's tokens: {why}. A draft "
                                      "model must share the served model's tokenizer (a smaller model of its family)")
            cparams = llama_cpp.llama_context_default_params()
            cparams.n_ctx = n_ctx
            cparams.n_batch = cparams.n_ubatch = chunk
            cparams.n_seq_max = 1
            cparams.n_threads = cparams.n_threads_batch = threads
            cparams.no_perf = True
            self.ctx = llama_cpp.llama_init_from_model(self.model, cparams)
            if self.ctx is None:
                raise DraftModelError(f"draft_model: llama.cpp could not make a context for {path.name} (out of "
                                      "memory?)")
        except BaseException:
            self.close()
            raise
        self.name = path.name
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.chunk = chunk
        self.batch = llama_cpp.llama_batch_init(chunk, 0, 1)
        self.tokens: list[int] = []  # what its KV holds, positions 0..len - 1
        self.seconds: float | None = None  # one drafted token's llama_decode, a moving average
        self.failures = 0  # llama_decode calls it refused (its KV then cleared, the guess skipped)
        self.usable = n_ctx

    def guess(self, history: list[int], n: int, limit: int) -> list[int]:
        """Up to n greedy tokens after `history` (a sequence's prompt, generated tokens and next token); tokens the
        served model does not have (ids from `limit` on) end the guess."""
        n = min(n, self.usable - len(history))
        if n <= 0 or not history:
            return []
        if not self._follow(history):
            return []
        guess: list[int] = []
        while True:
            token = int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, -1),
                                                        (self.n_vocab,))))
            if token >= limit:
                break
            guess.append(token)
            if len(guess) == n:
                break
            started = time.perf_counter()
            if not self._feed([token]):
                break
            took = time.perf_counter() - started
            self.seconds = took if self.seconds is None else 0.8 * self.seconds + 0.2 * took
        return guess

    def _follow(self, history: list[int]) -> bool:
        """Make the KV hold `history`: drop what follows the first difference, feed the rest (its last token's
        logits then give the first guess). False where history holds a token the draft has not."""
        held = self.tokens
        same = min(len(held), len(history) - 1)  # the last token is always fed: its logits are wanted
        if held[:same] != history[:same]:
            diff = np.flatnonzero(np.asarray(held[:same]) != np.asarray(history[:same]))
            same = int(diff[0])
        if same < len(held):
            llama_cpp.llama_memory_seq_rm(self.memory, 0, same, -1)
            del self.tokens[same:]
        rest = history[same:]
        if max(rest) >= self.n_vocab:  # a padding row of the model's vocabulary, or a client's own ids
            return False
        return self._feed(rest)

    def _feed(self, tokens: list[int]) -> bool:
        """Evaluate tokens after those held, in chunks; the last one's logits kept. False (the KV cleared) when
        llama.cpp refuses."""
        for start in range(0, len(tokens), self.chunk):
            part = tokens[start:start + self.chunk]
            b = self.batch
            b.n_tokens = 0
            for i, token in enumerate(part):
                add_row(b, token, len(self.tokens) + i, 0, i == len(part) - 1)
            if llama_cpp.llama_decode(self.ctx, b) != 0:
                log.warning("draft model %s: llama_decode refused %d tokens; its KV is cleared", self.name,
                            len(part))
                llama_cpp.llama_memory_seq_rm(self.memory, 0, -1, -1)
                self.tokens = []
                self.failures += 1
                return False
            self.tokens += part
        return True

    def close(self) -> None:
        free_context(self.ctx, getattr(self, "batch", None))  # no batch yet where its context could not be made
        self.ctx = self.batch = None
        if self.model is not None:
            llama_cpp.llama_model_free(self.model)
            self.model = None
