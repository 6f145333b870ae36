"""One API request's choices (n > 1, a list of prompts) as one stream of (choice index, event).

Each choice is a GenerateRequest of its own on the scheduler, so the engines batch them like any
other requests; this reads their streams side by side, in the order their events arrive.
"""

from __future__ import annotations

import asyncio

from syshaxd.sdk.types import Delta, Event, Rejected, RequestStream


class Fanout:
    def __init__(self, streams: list[RequestStream]) -> None:
        self.streams = streams
        self._queue: asyncio.Queue = asyncio.Queue()
        # one choice (the usual request) is read directly: no task and queue between it and the reader per token
        self._tasks = [asyncio.get_running_loop().create_task(self._pump(i, s)) for i, s in enumerate(streams)] \
            if len(streams) > 1 else []

    async def _pump(self, index: int, stream: RequestStream) -> None:
        while True:
            event = await self._read(stream)
            self._queue.put_nowait((index, event))
            if isinstance(event, Rejected) or (isinstance(event, Delta) and event.finish_reason):
                return

    @staticmethod
    async def _read(stream: RequestStream) -> Event:
        try:
            return await stream.next_event()
        except Exception as exc:  # never leave the reader waiting on a choice nobody feeds
            return Delta(stream.request_id, "", 0, "error", f"reading the engine failed: {exc}")

    async def next_event(self) -> tuple[int, Event]:
        if not self._tasks:
            return 0, await self._read(self.streams[0])
        return await self._queue.get()

    @property
    def route_stream(self) -> RequestStream:
        """Where the request ran, as the first choice's stream says (syshax's route note)."""
        return self.streams[0]

    def cancel(self) -> None:
        """Stop every choice still running (client gone, an error, or all done: then a no-op)."""
        for task in self._tasks:
            task.cancel()
        for stream in self.streams:
            stream.cancel()
