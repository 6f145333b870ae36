"""Registers the llama.cpp backend with syshax; imports llama.cpp only inside the worker."""

from __future__ import annotations

import importlib.util

from syshaxd.sdk.backend import Availability, Backend, Capabilities
from syshaxd.sdk.hookspecs import hookimpl


def _check() -> Availability:
    if importlib.util.find_spec("llama_cpp") is None:
        return Availability(False, "llama-cpp-python is not installed (pip install llama-cpp-python==0.3.36)")
    return Availability(True)


def _create(spec):
    if spec.role == "embed":  # an embedding model of [[models]]
        from syshax_llamacpp.embedding import LlamaCppEmbedder

        return LlamaCppEmbedder(spec)
    from syshax_llamacpp.engine import LlamaCppEngine

    return LlamaCppEngine(spec)


@hookimpl
def syshax_backends():
    return [
        Backend(
            name="llamacpp",
            device="cpu",
            roles=frozenset({"generate", "prefill", "decode", "embed"}),
            description="llama.cpp (llama-cpp-python 0.3.36) on CPU, q4_0, continuous batching",
            check=_check,
            factory=_create,
            # logprobs travel with a handed-on prompt's record (KVHandle.first_logprob, prompt_logprobs)
            capabilities=Capabilities(logprobs=True, prompt_logprobs=True, handed_on_logprobs=True, grammars=True,
                                      prefix_cache=True, kv_export=True, kv_import=True),
        )
    ]
