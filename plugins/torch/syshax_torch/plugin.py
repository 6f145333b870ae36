"""Registers the torch-device backends with syshax: torch (cuda or cpu) and npu (Ascend); imports torch only inside the worker."""

from __future__ import annotations

import glob
import importlib.util

from syshaxd.sdk.backend import Availability, Backend, Capabilities, requires_modules
from syshaxd.sdk.hookspecs import hookimpl

INSTALL_HINT = "pip install syshax-torch"
# it runs a prompt and writes its KV; it samples the first token greedily or plainly, with no logprobs or grammar
PREFILL_ONLY = Capabilities(kv_export=True)


def check_torch() -> Availability:
    return requires_modules("torch", "transformers", "safetensors", hint=INSTALL_HINT)


def check_npu() -> Availability:
    # find_spec, not import: the hook runs in the daemon, and torch_npu initialises the device runtime
    if importlib.util.find_spec("torch_npu") is None:
        return Availability(False, "no torch_npu: this host has no Ascend NPU support for torch "
                                   "(install CANN and torch_npu to prefill on an NPU)")
    return check_torch()


def cuda_present() -> bool:
    """An NVIDIA device node, without importing torch (the hook must stay cheap)."""
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def _create(device: str):
    def create(spec):
        from syshax_torch.engine import TorchPrefillEngine

        return TorchPrefillEngine(spec, device=device)

    return create


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
            factory=_create("auto"),
            capabilities=PREFILL_ONLY,
        ),
        Backend(
            name="npu",
            device="npu",
            roles=frozenset({"prefill"}),
            description="transformers/torch prefill on an Ascend NPU (torch_npu), KV into the ring",
            check=check_npu,
            factory=_create("npu"),
            capabilities=PREFILL_ONLY,
        ),
    ]
