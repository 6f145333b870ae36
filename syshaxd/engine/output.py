"""Turn a sequence's token bytes into text deltas: incremental UTF-8 and stop strings."""

from __future__ import annotations

import codecs


class TextStream:
    """Feeds token pieces (bytes) in, hands out text that is safe to send.

    Text is held back while it could still be the start of a stop string, and while a
    multi-byte UTF-8 character is incomplete; `stopped` turns true when a stop string
    appears, and the text before it is all that is ever emitted.
    """

    def __init__(self, stop: tuple[str, ...] = ()) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = tuple(s for s in stop if s)
        self._held = ""  # decoded text not yet emitted (a possible stop-string prefix)
        self.stopped = False

    def primed(self, pieces) -> "TextStream":
        """This stream after `pieces` went out elsewhere: their text is not sent again, but a stop string
        or a UTF-8 character that began in them still completes here (a decode moved between engines)."""
        for piece in pieces:
            self.feed(piece)
        return self

    def feed(self, piece: bytes) -> str:
        """Add one token's bytes; return the text that may be emitted now."""
        if self.stopped:
            return ""
        self._held += self._decoder.decode(piece)
        if not self._stop:
            out, self._held = self._held, ""
            return out
        earliest = -1
        for s in self._stop:
            i = self._held.find(s)
            if i != -1 and (earliest == -1 or i < earliest):
                earliest = i
        if earliest != -1:
            self.stopped = True
            out, self._held = self._held[:earliest], ""
            return out
        keep = self._longest_stop_prefix_suffix()
        cut = len(self._held) - keep
        out, self._held = self._held[:cut], self._held[cut:]
        return out

    def flush(self) -> str:
        """The sequence ended without a stop string: release whatever was held."""
        if self.stopped:
            return ""
        out = self._held + self._decoder.decode(b"", final=True)
        self._held = ""
        return out

    def _longest_stop_prefix_suffix(self) -> int:
        """Length of the longest end of the held text that begins some stop string."""
        best = 0
        held = self._held
        for s in self._stop:
            for n in range(min(len(s) - 1, len(held)), best, -1):
                if held.endswith(s[:n]):
                    best = n
                    break
        return best
