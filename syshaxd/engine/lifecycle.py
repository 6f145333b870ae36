"""The states an engine the scheduler holds passes through, a local worker or a decode node, and the moves allowed
between them, written once.

A WorkerHandle (engine/supervisor.py) and a RemoteNode (remote/front.py) each change their `state` only through
`Lifecycle.move`, which refuses a move its table does not hold: a new path through the supervisor or the front
that reaches a state from an unexpected one fails the tests that take it, instead of showing a status nobody
planned. The states are strings too (a StrEnum), as the status JSON, /metrics and the web page show them.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, overload


class HandleState(StrEnum):
    STOPPED = "stopped"  # not running: before its first start, or after a stop
    STARTING = "starting"  # a worker process spawned, its engine being built
    WARMING = "warming"  # built, proving its kernels at its warm-up
    READY = "ready"  # serving
    RESTARTING = "restarting"  # died; started again after worker_restart_delay
    FAILED = "failed"  # cannot serve as it is (its error says why); a worker is not restarted
    CONNECTING = "connecting"  # a decode node being dialled (its first time)
    LOADING = "loading"  # a decode node connected, none of its decoders ready yet
    UNREACHABLE = "unreachable"  # a decode node whose link is down; dialled again every second


_S = HandleState

# A local worker: spawned, built, warmed up, serving; a death restarts it unless it is judged unable to run
# (failed: in its warm-up or a crash loop, with no safer kernels left). Any state can be stopped.
WORKER_MOVES: dict[HandleState, frozenset[HandleState]] = {
    _S.STOPPED: frozenset({_S.STARTING, _S.STOPPED}),
    _S.STARTING: frozenset({_S.WARMING, _S.READY, _S.FAILED, _S.RESTARTING, _S.STOPPED}),
    _S.WARMING: frozenset({_S.READY, _S.FAILED, _S.RESTARTING, _S.STOPPED}),
    _S.READY: frozenset({_S.RESTARTING, _S.FAILED, _S.STOPPED}),
    _S.RESTARTING: frozenset({_S.STARTING, _S.FAILED, _S.STOPPED}),
    _S.FAILED: frozenset({_S.STOPPED}),
}

# A decode node as its front sees it: dialled, connected (loading until a decoder is ready), serving. Its link
# can drop at any time (unreachable) and come back; a node that refuses this front, or whose every decoder
# failed, is failed until a later dial or report says otherwise (an operator may fix and restart the node).
_NODE_LIVE = frozenset({_S.LOADING, _S.READY, _S.FAILED, _S.UNREACHABLE, _S.STOPPED})
NODE_MOVES: dict[HandleState, frozenset[HandleState]] = {
    _S.STOPPED: frozenset({_S.CONNECTING, _S.STOPPED}),
    _S.CONNECTING: _NODE_LIVE,
    _S.LOADING: _NODE_LIVE,
    _S.READY: _NODE_LIVE,
    _S.FAILED: _NODE_LIVE,
    _S.UNREACHABLE: _NODE_LIVE,
}


class IllegalMove(RuntimeError):
    """A state change its table does not hold: a bug in the code that made it, not something a user did."""


class Lifecycle:
    """One engine's state, changed only along the moves of its table."""

    def __init__(self, name: str, moves: dict[HandleState, frozenset[HandleState]]) -> None:
        self.name, self.moves = name, moves
        self.state = HandleState.STOPPED

    def move(self, new: HandleState) -> None:
        new = HandleState(new)
        if new != self.state and new not in self.moves.get(self.state, frozenset()):
            raise IllegalMove(f"{self.name}: {self.state} -> {new} is not a move its lifecycle allows "
                              f"(from {self.state}: {', '.join(sorted(self.moves.get(self.state, ())))})")
        self.state = new


class LifecycleState:
    """An engine handle's `state` attribute: read from its `lifecycle`, set only through Lifecycle.move."""

    @overload
    def __get__(self, obj: None, owner: Any = None) -> "LifecycleState": ...

    @overload
    def __get__(self, obj: Any, owner: Any = None) -> HandleState: ...

    def __get__(self, obj: Any, owner: Any = None) -> "HandleState | LifecycleState":
        return self if obj is None else obj.lifecycle.state

    def __set__(self, obj: Any, new: HandleState) -> None:
        obj.lifecycle.move(new)
