"""The lifecycle of an engine the scheduler holds (engine/lifecycle.py): every state is reachable and can be
stopped, a move its table lacks is refused, and the states are the strings the status shows."""

from __future__ import annotations

import json

import pytest

from syshaxd.engine.lifecycle import NODE_MOVES, WORKER_MOVES, HandleState, IllegalMove, Lifecycle


def _reachable(moves, start):
    seen, todo = {start}, [start]
    while todo:
        for nxt in moves.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


@pytest.mark.parametrize("moves, states", [
    (WORKER_MOVES, {"stopped", "starting", "warming", "ready", "restarting", "failed"}),
    (NODE_MOVES, {"stopped", "connecting", "loading", "ready", "failed", "unreachable"}),
])
def test_every_state_is_reachable_and_can_be_stopped(moves, states):
    assert set(moves) == states
    assert _reachable(moves, HandleState.STOPPED) == states
    for state in states:
        assert HandleState.STOPPED in _reachable(moves, HandleState(state)), f"{state} cannot be stopped"


def test_a_worker_moves_along_its_table_and_refuses_the_rest():
    life = Lifecycle("cpu0", WORKER_MOVES)
    for state in ("starting", "warming", "ready", "restarting", "starting", "failed"):
        life.move(HandleState(state))
        assert life.state == state and isinstance(life.state, HandleState)
    with pytest.raises(IllegalMove, match=r"cpu0: failed -> ready .*from failed: stopped"):
        life.move(HandleState.READY)
    assert life.state == HandleState.FAILED  # a refused move changes nothing
    life.move(HandleState.FAILED)  # staying is no move
    life.move(HandleState.STOPPED)


def test_a_node_is_dialled_before_it_serves():
    life = Lifecycle("node 10.0.0.2:7070", NODE_MOVES)
    with pytest.raises(IllegalMove):
        life.move(HandleState.READY)
    for state in ("connecting", "loading", "ready", "unreachable", "ready", "failed", "loading", "stopped"):
        life.move(HandleState(state))


def test_the_states_are_the_strings_the_status_shows():
    assert json.dumps({"state": HandleState.READY}) == '{"state": "ready"}'
    assert f"{HandleState.RESTARTING}" == "restarting" and HandleState.READY == "ready"


def test_a_worker_handle_changes_state_only_through_its_lifecycle():
    import asyncio

    from syshaxd.engine.supervisor import WorkerHandle
    from syshaxd.sdk.types import EngineSpec, Role

    async def check() -> None:
        worker = WorkerHandle("cpu0", EngineSpec(backend="llamacpp", role=Role.GENERATE, model_path="m.gguf",
                                                 model_name="m"), "info", 1.0)
        assert worker.state == HandleState.STOPPED and worker.lifecycle.moves is WORKER_MOVES
        with pytest.raises(IllegalMove, match="cpu0: stopped -> ready"):
            worker.state = HandleState.READY  # a worker serves only once started and built
        worker.state = HandleState.STARTING
        assert worker.lifecycle.state == HandleState.STARTING

    asyncio.run(check())
