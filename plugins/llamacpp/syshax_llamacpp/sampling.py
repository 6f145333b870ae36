"""Build a llama.cpp sampler chain for one sequence from the request's sampling parameters."""

from __future__ import annotations

import ctypes

import llama_cpp
import numpy as np

from syshaxd.engine.types import SamplingParams

PENALTY_LAST_N = 64


def make_sampler(params: SamplingParams, n_vocab: int) -> llama_cpp.llama_sampler_p:
    """A native sampler chain; the caller frees it with llama_sampler_free."""
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    add = lambda s: llama_cpp.llama_sampler_chain_add(chain, s)  # noqa: E731
    if params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0:
        add(
            llama_cpp.llama_sampler_init_penalties(
                n_vocab,
                PENALTY_LAST_N, params.repetition_penalty, params.frequency_penalty, params.presence_penalty
            )
        )
    if params.greedy:
        add(llama_cpp.llama_sampler_init_greedy())
        return chain
    if params.top_k > 0:
        add(llama_cpp.llama_sampler_init_top_k(params.top_k))
    if params.top_p < 1.0:
        add(llama_cpp.llama_sampler_init_top_p(params.top_p, 1))
    if params.min_p > 0.0:
        add(llama_cpp.llama_sampler_init_min_p(params.min_p, 1))
    add(llama_cpp.llama_sampler_init_temp(params.temperature))
    seed = llama_cpp.LLAMA_DEFAULT_SEED if params.seed is None else params.seed & 0xFFFFFFFF
    add(llama_cpp.llama_sampler_init_dist(seed))
    return chain


_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])  # llama_token_data


def sample_logits(sampler, logits: np.ndarray) -> int:
    """Sample a token from saved logits, as llama_sampler_sample does from a context's: every token's
    logit in id order, unsorted, through the chain, which then accepts the token."""
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
    token = int(array.data[array.selected].id)  # a sampler may point `data` elsewhere, as in llama_sampler_sample
    llama_cpp.llama_sampler_accept(sampler, token)
    return token
