"""A live progress line on stderr for one concurrency level: plain text, no dependency."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]

_WIDTH = 28
_REDRAW_S = 0.1


class Progress:
    """Redraws one stderr line as requests finish; does nothing when disabled.

    Enabled means stderr is a terminal or the user asked for --progress.
    """

    def __init__(self, enabled: bool, stream: TextIO | None = None):
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self._label = ""
        self._total = 0
        self._done = 0
        self._errors = 0
        self._tokens = 0
        self._started = 0.0
        self._drawn = 0.0

    @staticmethod
    def wanted(flag: bool, stream: TextIO | None = None) -> bool:
        stream = stream if stream is not None else sys.stderr
        return flag or (hasattr(stream, "isatty") and stream.isatty())

    def begin(self, label: str, total: int) -> None:
        self._label, self._total = label, total
        self._done = self._errors = self._tokens = 0
        self._started = time.perf_counter()
        self._draw(force=True)

    def advance(self, ok: bool, tokens: int) -> None:
        self._done += 1
        if ok:
            self._tokens += tokens
        else:
            self._errors += 1
        self._draw(force=self._done == self._total)

    def end(self) -> None:
        if self.enabled:
            self._draw(force=True)
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self._drawn < _REDRAW_S:
            return
        self._drawn = now
        elapsed = max(1e-9, now - self._started)
        filled = int(_WIDTH * self._done / self._total) if self._total else _WIDTH
        bar = "#" * filled + "-" * (_WIDTH - filled)
        line = (
            f"\r{self._label} [{bar}] {self._done}/{self._total}"
            f"  {self._done / elapsed:6.2f} req/s  {self._tokens / elapsed:8.1f} tok/s"
            f"  errors {self._errors}  {elapsed:6.1f}s"
        )
        self.stream.write(line)
        self.stream.flush()

    def note(self, message: str) -> None:
        """A status line (starting a daemon, a skip): printed whether or not the bar is on."""
        self.stream.write(message + "\n")
        self.stream.flush()
