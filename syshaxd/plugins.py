"""The one plugin manager: loads every `syshax` entry point and answers "who can do what"."""

from __future__ import annotations

import logging
import pluggy

from syshaxd import hookspecs
from syshaxd.backend import Backend

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "syshax"


class BackendNotFound(LookupError):
    """No plugin provides a backend of that name."""


def make_plugin_manager() -> pluggy.PluginManager:
    """A manager with every installed plugin loaded (built-in ones are entry points too)."""
    pm = pluggy.PluginManager("syshax")
    pm.add_hookspecs(hookspecs)
    pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
    return pm


def all_backends(pm: pluggy.PluginManager) -> list[Backend]:
    backends = [b for found in pm.hook.syshax_backends() for b in found]
    return sorted(backends, key=lambda b: b.name)


def find_backend(pm: pluggy.PluginManager, name: str) -> Backend:
    for backend in all_backends(pm):
        if backend.name == name:
            return backend
    known = ", ".join(b.name for b in all_backends(pm)) or "none"
    raise BackendNotFound(f"no backend named {name!r} is installed (installed: {known})")


def backends_for(pm: pluggy.PluginManager, role: str, device: str | None = None) -> list[Backend]:
    """Available backends that can take `role` (and run on `device`, when given)."""
    return [
        b
        for b in all_backends(pm)
        if role in b.roles and (device is None or b.device == device) and b.availability().available
    ]
