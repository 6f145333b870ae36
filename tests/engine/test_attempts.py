"""Every submission of a request to a worker is an attempt with its own id (engine/attempts.py): what a cancelled
attempt still sends never reaches the attempt after it, even on the same worker, and even with the same request id.
A real llama.cpp worker under a real WorkerHandle, busy with other sequences so that a step's events are in flight
when each Cancel goes."""

from __future__ import annotations

import asyncio

from conftest import MODEL_NAME
from syshaxd.engine.attempts import new_attempt, request_of
from syshaxd.engine.supervisor import WorkerHandle
from syshaxd.sdk.types import Accepted, Delta, EngineSpec, GenerateRequest, Role, SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def test_attempt_ids_are_new_every_time_and_name_their_request():
    ids = [new_attempt("chatcmpl-1") for _ in range(3)] + [new_attempt("cmpl-2-0")]
    assert len(set(ids)) == 4 and {request_of(a) for a in ids} == {"chatcmpl-1", "cmpl-2-0"}
    # a node's handle adds its own attempt to the front's: one hop up at a time
    node_side = new_attempt(ids[0])
    assert request_of(node_side) == ids[0] and request_of(request_of(node_side)) == "chatcmpl-1"
    assert request_of("no-attempt") == "no-attempt"


async def _tokens(stream, limit: int | None = None) -> list[int]:
    """The tokens of a stream's Deltas, until it finishes (or `limit` tokens)."""
    got: list[int] = []
    while limit is None or len(got) < limit:
        event = await asyncio.wait_for(stream.next_event(), 60)
        if isinstance(event, Accepted):
            continue
        assert isinstance(event, Delta), event
        assert event.request_id == stream.request_id  # the journey's id, never the attempt's
        assert event.finish_reason in (None, "length"), event
        got += event.tokens
        if event.finish_reason is not None:
            break
    return got


def test_a_cancelled_attempts_events_never_reach_the_next_one(default_model):
    spec = EngineSpec(backend="llamacpp", role=Role.GENERATE, model_path=str(default_model), model_name=MODEL_NAME,
                      n_ctx=512, max_batch_size=8, threads=1, tiled_attention=True)

    def ask(rid: str, prompt: str, max_tokens: int = 48) -> GenerateRequest:
        return GenerateRequest(rid, max_tokens=max_tokens, sampling=GREEDY, prompt=prompt, ignore_eos=True)

    async def go():
        handle = WorkerHandle("w", spec, "warning", restart_delay=0.1, heartbeat_timeout=0)
        handle.start()
        try:
            await asyncio.wait_for(handle.ready.wait(), 120)
            undisturbed = await _tokens(handle.submit(ask("r", "The story of the sea")))
            assert len(undisturbed) == 48
            # neighbours keep every step busy: each Cancel below lands while a step of "r" is under way
            busy = [handle.submit(ask(f"n{i}", f"Neighbour {i} says", 400)) for i in range(6)]
            for round_ in range(12):
                first = handle.submit(ask("r", "The story of the sea"))
                cut = 1 + round_ % 3
                assert (await _tokens(first, cut))[:cut] == undisturbed[:cut]
                first.cancel()
                again = handle.submit(ask("r", "The story of the sea"))  # the same request id, at once
                assert await _tokens(again) == undisturbed, f"round {round_}"
                await asyncio.sleep(0)
            for stream in busy:
                stream.cancel()
            assert handle.in_flight == 0
        finally:
            await handle.stop()

    asyncio.run(go())
