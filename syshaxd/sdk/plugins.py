"""The one plugin manager: loads every `syshax` entry point and answers "who can do what"."""

from __future__ import annotations

import logging
import pluggy

from syshaxd.sdk import hookspecs
from syshaxd.sdk.backend import Backend, Capabilities

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


def list_plugins() -> list[dict]:
    """Every installed backend: its roles, device, and whether it can run on this host (and why not)."""
    rows = []
    for b in all_backends(make_plugin_manager()):
        a = b.availability()
        rows.append({"name": b.name, "device": b.device, "roles": sorted(b.roles), "available": a.available,
                     "reason": a.reason, "description": b.description})
    return rows


def backend_capabilities(names: set[str]) -> dict[str, Capabilities]:
    """What each named backend declares it can do; nothing for a name no plugin provides (its workers cannot
    start: engine/plan.py says so at start-up)."""
    if not names:
        return {}
    found = {b.name: b.capabilities for b in all_backends(make_plugin_manager())}
    return {name: found.get(name, Capabilities()) for name in names}
