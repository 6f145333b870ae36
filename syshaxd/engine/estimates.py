"""Live estimates of what a request placed now on each side can expect: its decode speed (TPOT) and its TTFT.

Decider v2 (engine/decider.py, decide_measured) reads them. Journeys report what their requests got: each first
token's TTFT, by the route the request took, and each later token's gap, by the side that decoded it -- "gpu" (the
GPU engine decodes: the gpu route, or a decode moved back there) or "cpu" (a CPU worker or decode node decodes:
hetero, cpu). An estimate is an exponentially weighted mean over the recent observations, so it follows the load:
more requests on a side, longer steps there, a higher TPOT.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

# the weight of a new observation: about the last 20 count
ALPHA = 0.1
# an estimate older than this is from another load; it is still the best known, and its age is shown
STALE_S = 30.0


@dataclass
class Ewma:
    value: float | None = None
    n: int = 0
    at: float = 0.0  # monotonic time of the last observation

    def add(self, x: float, weight: int = 1) -> None:
        for _ in range(min(weight, 20)):  # a chunk of n tokens is n observations of its mean gap (20: enough to lead)
            self.value = x if self.value is None else self.value + ALPHA * (x - self.value)
        self.n += weight
        self.at = time.monotonic()


@dataclass(frozen=True)
class SideSpeed:
    """One side's estimates, in seconds (None: nothing observed yet)."""

    tpot_s: float | None
    ttft_s: float | None
    samples: int  # tokens whose gap was observed there
    age_s: float | None  # since the last observation


class Estimates:
    """TPOT per side ("gpu", "cpu") and TTFT per route ("gpu", "hetero", "cpu"), as requests report them."""

    def __init__(self) -> None:
        self._tpot: dict[str, Ewma] = {}
        self._ttft: dict[str, Ewma] = {}

    def first_token(self, route: str, seconds: float) -> None:
        self._ttft.setdefault(route, Ewma()).add(seconds)

    def tokens(self, side: str, gap_s: float, n: int) -> None:
        """n tokens arrived gap_s after the previous one of the same request, decoded on `side`."""
        if n > 0 and gap_s >= 0:
            self._tpot.setdefault(side, Ewma()).add(gap_s / n, n)

    def side(self, side: str, route: str) -> SideSpeed:
        tpot, ttft = self._tpot.get(side, Ewma()), self._ttft.get(route, Ewma())
        last = max(tpot.at, ttft.at)
        return SideSpeed(tpot.value, ttft.value, tpot.n, time.monotonic() - last if last else None)

    def to_json(self) -> dict:
        now = time.monotonic()
        return {"tpot_ms": {k: _ms(v.value) for k, v in self._tpot.items()},
                "ttft_ms": {k: _ms(v.value) for k, v in self._ttft.items()},
                "age_s": {k: round(now - v.at, 1) for k, v in self._tpot.items() if v.at}}


def _ms(seconds: float | None) -> float | None:
    return round(1000 * seconds, 2) if seconds is not None else None
