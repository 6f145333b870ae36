"""What a backend plugin declares: its roles, its device, whether it runs here, how to build it."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from enum import StrEnum
from typing import Callable

from syshaxd.engine.types import Engine, EngineSpec, Role


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
class Backend:
    """One engine kind. `create_engine` runs inside a worker process, never in the daemon."""

    name: str
    device: str
    roles: frozenset[str]
    description: str
    check: Callable[[], Availability]
    factory: Callable[[EngineSpec], Engine]

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
