"""Sampling: a llama.cpp sampler chain for one sequence from the request's parameters (and grammar), and the
engine's next token from a context's row with it.

Apart from stepping because a grammar makes sampling its own trade: a chain that must see every token the
request generated (here or in a prefill engine), logits sampled by hand where llama.cpp would abort the
process, and a request ended with a clear error when its grammar allows no token.
"""

from __future__ import annotations

import ctypes
import math

from typing import TYPE_CHECKING

import llama_cpp
import numpy as np

from syshax_llamacpp import logprobs
from syshaxd.sdk.types import Refusal, Rejected, SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from syshax_llamacpp.sequence import Sequence

PENALTY_LAST_N = 64


class GrammarError(ValueError):
    """llama.cpp would not parse the request's grammar."""


class GrammarDeadEnd(RuntimeError):
    """The grammar allows no token at this point (a client's grammar or regex with no way on)."""


def make_sampler(params: SamplingParams, n_vocab: int, grammar: str = "", vocab=None,
                 history=()) -> llama_cpp.llama_sampler_p:
    """A native sampler chain; the caller frees it with llama_sampler_free.

    With a grammar, the grammar sampler comes first (so top-k and the rest only ever see tokens it
    allows) and `history` -- tokens already generated elsewhere -- is accepted into the chain, so the
    grammar and the penalties continue from there. llama_sampler_sample on the chain accepts each
    sampled token into every sampler of it, the grammar included.
    """
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    add = lambda s: llama_cpp.llama_sampler_chain_add(chain, s)  # noqa: E731
    if grammar:
        g = llama_cpp.llama_sampler_init_grammar(vocab, grammar.encode(), b"root")
        if not g:
            llama_cpp.llama_sampler_free(chain)
            raise GrammarError("llama.cpp could not parse the request's grammar")
        add(g)
    if params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0:
        add(
            llama_cpp.llama_sampler_init_penalties(
                n_vocab,
                PENALTY_LAST_N, params.repetition_penalty, params.frequency_penalty, params.presence_penalty
            )
        )
    if params.greedy:
        add(llama_cpp.llama_sampler_init_greedy())
    else:
        if params.top_k > 0:
            add(llama_cpp.llama_sampler_init_top_k(params.top_k))
        if params.top_p < 1.0:
            add(llama_cpp.llama_sampler_init_top_p(params.top_p, 1))
        if params.min_p > 0.0:
            add(llama_cpp.llama_sampler_init_min_p(params.min_p, 1))
        add(llama_cpp.llama_sampler_init_temp(params.temperature))
        seed = llama_cpp.LLAMA_DEFAULT_SEED if params.seed is None else params.seed & 0xFFFFFFFF
        add(llama_cpp.llama_sampler_init_dist(seed))
    for token in history:
        if not accept(chain, token, bool(grammar)):
            llama_cpp.llama_sampler_free(chain)
            raise GrammarError(f"token {token}, generated before, does not match the request's grammar")
    return chain


_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])  # llama_token_data


def sample_logits(sampler, logits: np.ndarray, grammar: bool = False) -> int:
    """Sample a token from saved logits, as llama_sampler_sample does from a context's: every token's
    logit in id order, unsorted, through the chain, which then accepts the token.

    grammar: the chain starts with a grammar; a choice it forbade (every token was) raises GrammarDeadEnd
    before the chain accepts it -- llama.cpp would throw inside the accept and abort the process."""
    assert ctypes.sizeof(llama_cpp.llama_token_data) == _TOKEN_DATA.itemsize
    cur = np.zeros(len(logits), _TOKEN_DATA)
    cur["id"] = np.arange(len(logits), dtype=np.int32)
    cur["logit"] = logits
    array = llama_cpp.llama_token_data_array(
        data=cur.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data)), size=len(cur), selected=-1,
        sorted=False)
    llama_cpp.llama_sampler_apply(sampler, ctypes.byref(array))
    if not 0 <= array.selected < array.size:
        raise RuntimeError(f"the sampler chain selected no token ({array.selected})")
    chosen = array.data[array.selected]  # a sampler may point `data` elsewhere, as in llama_sampler_sample
    if grammar and math.isinf(chosen.logit) and chosen.logit < 0:
        raise GrammarDeadEnd("the grammar allows no token here")
    token = int(chosen.id)
    llama_cpp.llama_sampler_accept(sampler, token)
    return token


def grammar_parses(vocab, grammar: str) -> bool:
    """Whether llama.cpp takes the grammar (checked when a request arrives, so a bad one is a 400, not a failed
    generation)."""
    g = llama_cpp.llama_sampler_init_grammar(vocab, grammar.encode(), b"root")
    if not g:
        return False
    llama_cpp.llama_sampler_free(g)
    return True


def accept(chain, token: int, grammar: bool) -> bool:
    """Accept a token sampled elsewhere (a prefill engine's first token) into the chain, as sampling here
    would have. False, accepting nothing, when the grammar forbids it: llama.cpp aborts the process on a
    grammar accept that leaves no way on, so the token is checked against the grammar first."""
    if grammar:
        cell = llama_cpp.llama_token_data(token, 0.0, 0.0)
        cur = llama_cpp.llama_token_data_array(ctypes.pointer(cell), 1, -1, False)
        llama_cpp.llama_sampler_apply(llama_cpp.llama_sampler_chain_get(chain, 0), ctypes.byref(cur))
        if math.isinf(cell.logit):
            return False
    llama_cpp.llama_sampler_accept(chain, token)
    return True


class RowSampler:
    """The one owner of the sequences' sampler chains: made at a sequence's start, freed at its end; and each next
    token from a context's row (or saved logits) through them."""

    def __init__(self, n_vocab: int, vocab) -> None:
        self.n_vocab = n_vocab
        self.vocab = vocab  # llama_vocab_p: a grammar's tokens

    def start(self, seq: Sequence) -> None:
        """seq's chain, from its request's parameters; a decode moved here continues its grammar (and penalties)
        after what it generated. GrammarError when the grammar does not take those tokens."""
        seq.sampler = make_sampler(seq.request.sampling, self.n_vocab, seq.request.grammar, self.vocab,
                                   seq.handling.resume_tokens)

    def free(self, seq: Sequence) -> None:
        if seq.sampler is not None:
            llama_cpp.llama_sampler_free(seq.sampler)
            seq.sampler = None

    def sample(self, seq: Sequence, ctx, i: int) -> tuple[int, TokenLogprob | None]:
        """The next token from batch row i of ctx, and its logprob when the request asked for them. GrammarDeadEnd when
        the request's grammar allows no token: sampled by hand then, as llama.cpp would abort the process."""
        if seq.request.grammar:
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), (self.n_vocab,))
            token = sample_logits(seq.sampler, logits, grammar=True)
        else:
            token = llama_cpp.llama_sampler_sample(seq.sampler, ctx, i)
        k = seq.request.logprobs
        return token, (logprobs.at(ctx, i, self.n_vocab, token, k) if k is not None else None)

    def sample_saved(self, seq: Sequence, logits: np.ndarray) -> tuple[int, TokenLogprob | None]:
        """The next token from saved logits (a whole prompt's, from the prefix cache); GrammarDeadEnd as sample."""
        token = sample_logits(seq.sampler, logits, grammar=bool(seq.request.grammar))
        k = seq.request.logprobs
        return token, (logprobs.of_logits(logits, token, k) if k is not None else None)

    def accept_first(self, seq: Sequence, token: int) -> bool:
        """The prefill engine sampled seq's first token: the chain here (its grammar) must see it too. False when the
        grammar forbids it."""
        return accept(seq.sampler, token, bool(seq.request.grammar))


def dead_end(seq: Sequence) -> Rejected | str:
    """The request's grammar allows no token at this point: a 400 naming the field while nothing was generated (no
    token of the vocabulary can start the output), else the error that ends it after the text so far."""
    done = seq.out.n_generated if seq.out is not None else 0
    field = seq.request.grammar_field
    if done == 0:
        return Rejected(seq.request.request_id, Refusal.INVALID, f"The output constraint '{field}' allows no "
                        "first token: no token of this model's vocabulary can start it. Check the grammar or "
                        "pattern.",
                        "unsupported_schema", field)
    return (f"the output constraint ('{field}') allows no token after {done} tokens: it has no way on here; check the "
            "grammar or pattern")
