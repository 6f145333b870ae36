"""Registers the torch prefill backend with syshax; imports torch only inside the worker."""

from __future__ import annotations

import glob
import importlib.util

from syshaxd.backend import Availability, Backend
from syshaxd.hookspecs import hookimpl

INSTALL_HINT = 'pip install "syshax[torch]"'


def missing_modules(*names: str) -> list[str]:
    return [n for n in names if importlib.util.find_spec(n) is None]


def check_torch() -> Availability:
    missing = missing_modules("torch", "transformers", "safetensors")
    if missing:
        return Availability(False, f"{', '.join(missing)} not installed ({INSTALL_HINT})")
    return Availability(True)


def cuda_present() -> bool:
    """An NVIDIA device node, without importing torch (the hook must stay cheap)."""
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def _create(spec):
    from syshax_torch.engine import TorchPrefillEngine

    return TorchPrefillEngine(spec, device="auto")


@hookimpl
def syshax_backends():
    on_gpu = cuda_present()
    return [
        Backend(
            name="torch",
            device="gpu" if on_gpu else "cpu",
            roles=frozenset({"prefill"}),
            description=f"transformers/torch prefill on {'cuda' if on_gpu else 'cpu'}, KV into the ring",
            check=check_torch,
            factory=_create,
        )
    ]
