"""The slot table: which sequences the engine holds, which wait for a batch slot, and how many slots are free.

The one owner of a sequence's place in the engine. A sequence that decodes here waits in the queue until one of the
max_batch_size slots frees, oldest first; one whose prompt is only handed on takes no slot and starts at once. The
table moves a sequence into its prompt (PROMPT) and out (DONE); the decode batch moves it into DECODING when it takes
a stream. Every move goes through Sequence.enter, which refuses one that sequence.TRANSITIONS does not allow.
"""

from __future__ import annotations

from collections import deque

from syshax_llamacpp.sequence import Sequence, SlotState


class SlotTable:
    """Sequences by request id: `queued` (in arrival order) and `active` (started: a prompt or a decode)."""

    def __init__(self, max_seqs: int) -> None:
        self.max_seqs = max_seqs
        self.waiting: deque[Sequence] = deque()  # oldest first: the head is never overtaken, so none starves
        self.queued: dict[str, Sequence] = {}
        self.active: dict[str, Sequence] = {}
        self.seated = 0  # active sequences holding a batch slot

    @property
    def free_slots(self) -> int:
        return self.max_seqs - self.seated

    def queue(self, seq: Sequence) -> None:
        """A sequence that decodes here waits for a slot."""
        self.waiting.append(seq)
        self.queued[seq.request_id] = seq

    def seat_next(self) -> Sequence | None:
        """A free slot to the queue's head, to be started; None when none is free or none waits. One at a time: a
        sequence that ends as it starts (its first token its last, or a grammar refused) frees its slot for the next
        at once."""
        if not self.waiting or self.free_slots <= 0:
            return None
        seq = self.waiting.popleft()
        del self.queued[seq.request_id]
        self.seated += 1
        return self._activate(seq)

    def start_unseated(self, seq: Sequence) -> Sequence:
        """A sequence whose prompt is only handed on starts at once, without a slot (it never decodes here)."""
        if seq.decodes_here:
            raise RuntimeError(f"{seq.request_id} decodes here: it waits for a slot (queue, seat_next)")
        return self._activate(seq)

    def _activate(self, seq: Sequence) -> Sequence:
        """seq is active: its prompt runs (or its KV record is read) from now."""
        seq.enter(SlotState.PROMPT)
        self.active[seq.request_id] = seq
        return seq

    def unqueue(self, request_id: str) -> Sequence | None:
        """Take a sequence out of the queue (cancelled before it was seated); None when it is not queued."""
        seq = self.queued.pop(request_id, None)
        if seq is not None:
            self.waiting.remove(seq)
            seq.enter(SlotState.DONE)
        return seq

    def leave(self, seq: Sequence) -> bool:
        """seq is done: out of the table, its slot free. False when it had left already."""
        if seq.state is SlotState.DONE:
            return False
        self.active.pop(seq.request_id, None)
        if seq.decodes_here and seq.state is not SlotState.QUEUED:  # seated by seat_next, the one way it starts
            self.seated -= 1
        seq.enter(SlotState.DONE)
        return True

    def decoding(self) -> list[Sequence]:
        """The sequences with a token to feed this step, in stream order (streams.py says why)."""
        return sorted((s for s in self.active.values() if s.next_token is not None), key=lambda s: s.seq_id)

    def next_prompt(self) -> Sequence | None:
        """The oldest started sequence with prompt tokens still to run."""
        return next((s for s in self.active.values() if s.pending), None)

    def has_work(self) -> bool:
        return bool(self.active) or (bool(self.waiting) and self.free_slots > 0)

    def kv_tokens(self) -> int:
        """Tokens the active sequences hold in the KV cache."""
        return sum(s.n_past for s in self.active.values())
