"""Registers the llama.cpp backend with syshax; imports llama.cpp only inside the worker."""

from __future__ import annotations

import importlib.util

from syshaxd.backend import Availability, Backend
from syshaxd.hookspecs import hookimpl


def _check() -> Availability:
    if importlib.util.find_spec("llama_cpp") is None:
        return Availability(False, "llama-cpp-python is not installed (pip install llama-cpp-python==0.3.36)")
    return Availability(True)


def _create(spec):
    from syshax_llamacpp.engine import LlamaCppEngine

    return LlamaCppEngine(spec)


@hookimpl
def syshax_backends():
    return [
        Backend(
            name="llamacpp",
            device="cpu",
            roles=frozenset({"generate", "prefill", "decode"}),
            description="llama.cpp (llama-cpp-python 0.3.36) on CPU, q4_0, continuous batching",
            check=_check,
            factory=_create,
        )
    ]
