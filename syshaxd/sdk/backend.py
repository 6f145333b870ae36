"""What a backend plugin declares: its roles, its device, whether it runs here, how to build it."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from enum import StrEnum
from typing import Callable

from syshaxd.sdk.types import Engine, EngineSpec, Role


class Device(StrEnum):
    CPU = "cpu"
    GPU = "gpu"
    NPU = "npu"


ROLES = tuple(Role)
DEVICES = tuple(Device)


@dataclass(frozen=True)
class Availability:
    available: bool
    reason: str = ""


@dataclass(frozen=True)
class Capabilities:
    """What a backend's engines can do beyond generating text. The daemon refuses a request that asks an engine
    for something it lacks, before any engine sees it, with one error for every backend (engine/capabilities.py)."""

    logprobs: bool = False  # the generated tokens' logprobs, where it generates
    prompt_logprobs: bool = False  # every prompt token's logprobs (echo), where it generates
    handed_on_logprobs: bool = False  # a prompt it runs for a decoder elsewhere: its logprobs travel with the KV
    grammars: bool = False  # samples under a GBNF grammar (structured output), its first token too
    prefix_cache: bool = False  # reads and fills the daemon's prefix cache
    kv_export: bool = False  # writes a prompt's KV record into the ring (prefill, handoff)
    kv_import: bool = False  # continues from a KV record read from the ring (decode)
    # keeps a prefix cache of its own (vLLM's), which hits only on prompts this engine ran: in a pool of them the
    # scheduler places a request where its prefix is (engine/prefix_routing.py)
    own_prefix_cache: bool = False


@dataclass(frozen=True)
class Backend:
    """One engine kind. `create_engine` runs inside a worker process, never in the daemon."""

    name: str
    device: str
    roles: frozenset[str]
    description: str
    check: Callable[[], Availability]
    factory: Callable[[EngineSpec], Engine]
    capabilities: Capabilities = Capabilities()

    def __post_init__(self) -> None:
        bad = set(self.roles) - set(ROLES)
        if bad or self.device not in DEVICES:
            raise ValueError(f"backend {self.name}: roles must be in {ROLES}, device in {DEVICES}")

    def availability(self) -> Availability:
        try:
            return self.check()
        except Exception as exc:  # a plugin's probe must not take the daemon down
            return Availability(False, f"availability check failed: {exc}")

    def create_engine(self, spec: EngineSpec) -> Engine:
        return self.factory(spec)


def requires_modules(*modules: str, hint: str) -> Availability:
    """Available when every module is installed, else which are missing and `hint` (how to install them).

    find_spec, not import: availability is asked in the daemon, which must stay light.
    """
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        return Availability(False, f"{', '.join(missing)} not installed ({hint})")
    return Availability(True)
