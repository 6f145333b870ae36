"""Recent tokens per second of an engine, over a sliding window (what the decider and status read)."""

from __future__ import annotations

import time
from collections import deque


class TokenRate:
    def __init__(self, window: float = 5.0) -> None:
        self.window = window
        self._steps: deque[tuple[float, int]] = deque()  # (time, tokens) of recent steps

    def add(self, n: int) -> None:
        now = time.monotonic()
        self._steps.append((now, n))
        while self._steps and now - self._steps[0][0] > self.window:
            self._steps.popleft()

    def per_second(self) -> float:
        if len(self._steps) < 2:
            return 0.0
        span = self._steps[-1][0] - self._steps[0][0]
        return sum(n for _, n in self._steps) / span if span > 0 else 0.0
