"""The hooks a syshax plugin may implement; every backend, built-in or third-party, is one."""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("syshax")
hookimpl = pluggy.HookimplMarker("syshax")


@hookspec
def syshax_backends():
    """Return a list of `syshaxd.sdk.backend.Backend` objects this plugin provides.

    Called in the daemon (to list and choose backends) and again inside each worker
    process (to build the engine there), so it must be cheap and import nothing heavy:
    put engine imports inside `Backend.create_engine`.
    """
