"""`syshax cache warm FILE`: a prompt computed once ahead of traffic, so that the prefix cache (and its disk tier)
holds its blocks when the first real request arrives (an agent's system prompt, a long shared document).

A prompt is warmed by running it as a request that generates one token, greedy, through the scheduler like any
other: the blocks it keeps are the very ones a real request would keep. The whole prompt's last chunk is kept too.
"""

from __future__ import annotations

import asyncio
import uuid

from syshaxd.sdk.types import Accepted, Delta, GenerateRequest, Rejected, SamplingParams


class WarmError(Exception):
    """The entry cannot be warmed: the message says what was wrong."""


def request_of(entry: object) -> GenerateRequest:
    """The one-token request for a warm entry: {"prompt": text} or {"messages": [...]} (a chat's first messages,
    rendered with the model's template as a chat request's are)."""
    if not isinstance(entry, dict) or ("prompt" in entry) == ("messages" in entry):
        raise WarmError('each entry is a JSON object with "prompt" (a text) or "messages" (a chat\'s messages)')
    rid = f"warm-{uuid.uuid4().hex[:12]}"
    greedy = SamplingParams(temperature=0.0)
    if "prompt" in entry:
        if not isinstance(entry["prompt"], str) or not entry["prompt"]:
            raise WarmError('"prompt" must be a non-empty string')
        return GenerateRequest(rid, 1, greedy, prompt=entry["prompt"])
    messages = entry["messages"]
    if (not isinstance(messages, list) or not messages
            or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)):
        raise WarmError('"messages" must be a non-empty list of {"role": ..., "content": ...} objects')
    return GenerateRequest(rid, 1, greedy, messages=tuple(messages))


async def warm(scheduler, entry: object, timeout: float) -> dict:
    """Run the entry's prompt for one token; its prompt tokens and how many of them were cached already."""
    request = request_of(entry)
    prepared = await scheduler.prepare([request])
    if isinstance(prepared, Rejected):
        raise WarmError(prepared.message)
    stream = scheduler.submit(prepared[0])
    accepted: Accepted | None = None
    try:
        async with asyncio.timeout(timeout):
            while True:
                event = await stream.next_event()
                if isinstance(event, Rejected):
                    raise WarmError(event.message)
                if isinstance(event, Accepted):
                    accepted = event
                elif isinstance(event, Delta) and event.finish_reason is not None:
                    if event.finish_reason == "error":
                        raise WarmError(event.error or "the engine failed")
                    break
    except TimeoutError:
        raise WarmError(f"not done within {timeout:g}s (request_timeout)") from None
    finally:
        stream.cancel()
    assert accepted is not None
    return {"prompt_tokens": accepted.prompt_tokens, "cached_tokens": accepted.cached_tokens}
