"""Registers the NPU prefill backend: available where torch_npu imports, otherwise listed with why not."""

from __future__ import annotations

import importlib.util

from syshaxd.backend import Availability, Backend
from syshaxd.hookspecs import hookimpl


def _check() -> Availability:
    # find_spec, not import: the hook runs in the daemon, and torch_npu initialises the device runtime
    if importlib.util.find_spec("torch_npu") is None:
        return Availability(False, "no torch_npu: this host has no Ascend NPU support for torch "
                                   "(install CANN and torch_npu to prefill on an NPU)")
    from syshax_torch.plugin import check_torch

    return check_torch()


def _create(spec):
    from syshax_torch.engine import TorchPrefillEngine

    return TorchPrefillEngine(spec, device="npu")


@hookimpl
def syshax_backends():
    return [
        Backend(
            name="npu",
            device="npu",
            roles=frozenset({"prefill"}),
            description="transformers/torch prefill on an Ascend NPU (torch_npu), KV into the ring",
            check=_check,
            factory=_create,
        )
    ]
