"""The chat scenario: conversations that share one system prompt and resend their whole history every turn.

Each conversation is a closed loop of its own: turn n sends
[system, user 1, assistant 1, ..., user n] to /v1/chat/completions, where each
assistant message is what the server answered to that turn, so the prompt grows
by one question and one answer per turn. `concurrency` conversations run at
once. A server that keeps the previous turn's KV (a prompt cache) evaluates only
the new tail; one that does not evaluates the whole history again, and its TTFT
climbs with the turn number: the per-turn figures show which.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp

from .client import LevelRun, RequestRecord, StreamingClient
from .prompts import Prompt

__all__ = ["Conversation", "build_conversations", "run_conversations"]

# The seed offset of the system prompt: one text shared by every conversation, level and target.
_SYSTEM_SEED = 0x5E5


@dataclass(frozen=True)
class Conversation:
    """One conversation's fixed parts: the shared system prompt (None for none) and its user turns."""

    index: int
    system: Prompt | None
    users: tuple[Prompt, ...]


def build_conversations(
    builder,
    count: int,
    *,
    system_len: int,
    turn_len: int,
    turns: int,
    seed: int,
    user_seed: Callable[[int], int],
) -> list[Conversation]:
    """count conversations of `turns` user messages of turn_len tokens each, behind one system prompt.

    user_seed(k) gives the seed of the k-th user message of the level (k = conversation * turns + turn - 1),
    so the same conversation says the same things to every target.
    """
    if turns < 1:
        raise ValueError(f"--turns: {turns} is not allowed; it must be at least 1")
    if system_len < 0:
        raise ValueError(f"--system-len: {system_len} is not allowed; it must be 0 (no system prompt) or more")
    system = builder.build(system_len, seed * 1_000_003 + _SYSTEM_SEED) if system_len else None
    return [
        Conversation(c, system, tuple(builder.build(turn_len, user_seed(c * turns + t)) for t in range(turns)))
        for c in range(count)
    ]


async def run_conversations(
    client: StreamingClient,
    session: aiohttp.ClientSession,
    conversations: Sequence[Conversation],
    concurrency: int,
    on_record: Callable[[RequestRecord], None] | None = None,
    output_len: int | None = None,
) -> LevelRun:
    """Run every conversation, `concurrency` at once, turn after turn; one record per turn.

    A record's input_tokens is the history it resent as the tokenizer counts it (system, user
    messages, and the server's own counts of its earlier answers), chat template not included.
    A failed turn ends its conversation: the turns after it are recorded as failed with the kind
    `after_failed_turn`, never dropped.
    """
    if client.endpoint != "chat":
        raise ValueError("the chat scenario needs the chat endpoint")
    pending = deque(conversations)
    records: list[RequestRecord] = []
    level_start = time.perf_counter()

    def keep(record: RequestRecord) -> None:
        records.append(record)
        if on_record is not None:
            on_record(record)

    async def worker() -> None:
        while pending:
            conv = pending.popleft()
            turns = len(conv.users)
            messages: list[dict] = []
            history = 0
            if conv.system is not None:
                messages.append({"role": "system", "content": conv.system.text})
                history = conv.system.n_tokens
            for turn, user in enumerate(conv.users, 1):
                index = conv.index * turns + turn - 1
                messages.append({"role": "user", "content": user.text})
                history += user.n_tokens
                answer: list[str] = []
                record = await client.send(session, index, user, level_start, output_len,
                                           messages=list(messages), text_out=answer)
                record.conversation, record.turn, record.input_tokens = conv.index, turn, history
                keep(record)
                if not record.ok:
                    for later, unsent in enumerate(conv.users[turn:], turn + 1):
                        keep(RequestRecord(
                            index=conv.index * turns + later - 1, seed=unsent.seed, input_tokens=0,
                            start_s=time.perf_counter() - level_start, e2e_s=0.0, error="after_failed_turn",
                            error_detail=f"not sent: turn {turn} of this conversation failed ({record.error})",
                            max_tokens=record.max_tokens, conversation=conv.index, turn=later,
                        ))
                    break
                messages.append({"role": "assistant", "content": "".join(answer)})
                history += record.output_tokens

    await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, len(conversations))))))
    wall_s = time.perf_counter() - level_start
    records.sort(key=lambda r: r.index)
    return LevelRun(concurrency, records, wall_s)
