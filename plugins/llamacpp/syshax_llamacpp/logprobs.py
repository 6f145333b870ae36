"""Log-probabilities from a llama.cpp context's logits: the raw model distribution, before any sampler.

One definition everywhere (decode, prompt, hetero's prefill engine): log-softmax of the logits
row llama.cpp computed for a batch position, in float64; temperature, penalties and top-k/top-p
shape only what is sampled, not what is reported (vLLM's default, and what lm-eval's
loglikelihood expects).
"""

from __future__ import annotations

import llama_cpp
import numpy as np

from syshaxd.sdk.types import TokenLogprob

_BLOCK = 32  # prompt rows turned into logprobs at once


def _row(ctx, i: int, n_vocab: int) -> np.ndarray:
    ptr = llama_cpp.llama_get_logits_ith(ctx, i)
    return np.ctypeslib.as_array(ptr, shape=(n_vocab,)).astype(np.float64)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _entry(lp: np.ndarray, token: int, k: int) -> TokenLogprob:
    top: tuple = ()
    if k > 0:
        best = np.argpartition(-lp, k - 1)[:k] if k < lp.shape[0] else np.arange(lp.shape[0])
        best = best[np.argsort(-lp[best], kind="stable")]
        top = tuple((int(t), float(lp[t])) for t in best)
    return TokenLogprob(int(token), float(lp[token]), top)


def at(ctx, i: int, n_vocab: int, token: int, k: int) -> TokenLogprob:
    """token's logprob at batch row i (which must have asked for logits), with the k most likely there."""
    return _entry(_log_softmax(_row(ctx, i, n_vocab)), token, k)


def prompt_chunk(ctx, n_rows: int, n_vocab: int, next_tokens: list[int], k: int) -> list[TokenLogprob]:
    """Rows 0..len(next_tokens)-1 of a prompt chunk decoded with logits on every row: row j predicts
    next_tokens[j] (the prompt's token after that position)."""
    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits(ctx), shape=(n_rows, n_vocab))
    out = []
    for start in range(0, len(next_tokens), _BLOCK):  # a block at a time: a whole chunk in float64 is 100 MB
        block = _log_softmax(logits[start:start + _BLOCK].astype(np.float64))
        out += [_entry(row, token, k) for row, token in zip(block, next_tokens[start:start + _BLOCK])]
    return out


def of_logits(logits: np.ndarray, token: int, k: int) -> TokenLogprob:
    """The same from a saved logits row (a whole prompt taken from the prefix cache)."""
    return _entry(_log_softmax(logits.astype(np.float64)), token, k)
