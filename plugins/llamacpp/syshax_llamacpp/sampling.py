"""Build a llama.cpp sampler chain for one sequence from the request's sampling parameters."""

from __future__ import annotations

import llama_cpp

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
