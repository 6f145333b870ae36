"""Which KV stream of the batch context each decoding sequence uses, kept as one run of consecutive ids.

With one KV stream per sequence (kv_unified = false), llama.cpp takes a decode batch in one ubatch
only when its rows' sequence ids are consecutive and ascending (llama_batch_allocr::split_equal with
sequential = true); a gap or an inversion starts a new ubatch, and every ubatch is another pass over
the weights. Measured with 8 sequences on this model: rows 0..7 15.7 ms a step, 1..7,0 26.3 ms,
7..0 39.7 ms, 0,2,4,6 19.2 ms against 10.6 ms for 0..3. So a sequence joining the batch takes the
lowest hole in the run, or the id next to it; one leaving from inside the run leaves a hole that the
engine fills by moving an end of the run into it (`holes`), and rows go to llama_decode in id order.
"""

from __future__ import annotations


class StreamRun:
    """The stream ids of decoding sequences: `take` one when a sequence joins, `give_back` when it leaves."""

    def __init__(self, n_streams: int) -> None:
        self.n_streams = n_streams
        self.busy: set[int] = set()

    def take(self) -> int:
        """An id that keeps the run consecutive: its lowest hole, else the next id above it, else below it."""
        if not self.busy:
            self.busy.add(0)
            return 0
        lo, hi = min(self.busy), max(self.busy)
        holes = self.holes()
        if holes:
            pick = holes[0]
        elif hi + 1 < self.n_streams:
            pick = hi + 1
        elif lo > 0:
            pick = lo - 1
        else:
            raise RuntimeError(f"all {self.n_streams} KV streams are in use")
        self.busy.add(pick)
        return pick

    def give_back(self, stream: int) -> None:
        self.busy.discard(stream)

    def moved(self, source: int, target: int) -> None:
        """A sequence's KV moved from stream `source` into the hole `target`."""
        self.busy.discard(source)
        self.busy.add(target)

    def holes(self) -> list[int]:
        """Free ids between the lowest and highest busy one, lowest first."""
        if not self.busy:
            return []
        return [i for i in range(min(self.busy), max(self.busy)) if i not in self.busy]

    def ends(self) -> tuple[int, int]:
        return min(self.busy), max(self.busy)

    def consecutive(self) -> bool:
        return not self.holes()
