"""Turn a sequence's tokens into text deltas and finish reasons: incremental UTF-8, stop strings, EOS, max_tokens."""

from __future__ import annotations

import codecs
from typing import TYPE_CHECKING, Callable, Iterable

if TYPE_CHECKING:
    from syshaxd.sdk.types import GenerateRequest


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


class SequenceOutput:
    """One sequence's finish rules, the same in every engine: per sampled token, the text to send and why it ended.

    An end-of-generation token ends it with "stop" (unless ignore_eos), as does a stop string (the
    text before it is all that goes out); the max_tokens-th token ends it with "length". Whatever
    text was held back goes out with the finishing token. `resume_tokens` went out elsewhere (a
    decode moved between engines): their text is not sent again, and they do not count here.
    """

    def __init__(self, *, stop: tuple[str, ...], ignore_eos: bool, max_tokens: int,
                 is_eog: Callable[[int], bool], piece_bytes: Callable[[int], bytes],
                 resume_tokens: Iterable[int] = ()) -> None:
        self.ignore_eos = ignore_eos
        self.max_tokens = max_tokens
        self.n_generated = 0
        self._is_eog = is_eog
        self._piece_bytes = piece_bytes
        self.text = TextStream(stop).primed(piece_bytes(t) for t in resume_tokens)

    @classmethod
    def for_request(cls, request: "GenerateRequest", max_tokens: int, is_eog: Callable[[int], bool],
                    piece_bytes: Callable[[int], bytes], resume_tokens: Iterable[int] = ()) -> "SequenceOutput":
        return cls(stop=request.stop, ignore_eos=request.ignore_eos, max_tokens=max_tokens, is_eog=is_eog,
                   piece_bytes=piece_bytes, resume_tokens=resume_tokens)

    def token(self, token: int) -> tuple[str, str | None]:
        """(text to send now, finish reason or None) for the next sampled token."""
        self.n_generated += 1
        if self._is_eog(token) and not self.ignore_eos:
            return self.text.flush(), "stop"
        text = self.text.feed(self._piece_bytes(token))
        if self.text.stopped:
            return text, "stop"
        if self.n_generated >= self.max_tokens:
            return text + self.text.flush(), "length"
        return text, None

    def flush(self) -> str:
        """The text still held back, for a sequence that ends some other way (an error)."""
        return self.text.flush()
