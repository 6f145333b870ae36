"""The last few minutes of serving, in buckets of a few seconds: tokens generated, requests finished, TTFT and TPOT.

What the web page (api/web/routes.py) charts, read from /v1/syshax/status as "recent". The same
observations feed /metrics' histograms (metrics.RequestTimer); this keeps only a short window, as
plain numbers per bucket and, for the window's p50 and p99, each request's TTFT and each token gap,
so that the page computes nothing but where to draw them.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

MAX_SAMPLES = 50_000  # the window's latency samples kept for its quantiles (oldest first out past it)


@dataclass
class _Bucket:
    start: float
    tokens: int = 0
    finished: int = 0
    ttft_sum: float = 0.0
    ttft_n: int = 0
    tpot_sum: float = 0.0
    tpot_n: int = 0


def quantiles(samples, qs=(0.5, 0.99)) -> list[float | None]:
    """The weighted quantiles of (value, weight) samples: for each q the smallest value with at least q of the
    weight at or below it (None without samples)."""
    ordered = sorted(samples)
    if not ordered:
        return [None for _ in qs]
    cumulative, total = [], 0
    for _, weight in ordered:
        total += weight
        cumulative.append(total)
    return [ordered[min(len(ordered) - 1, bisect.bisect_left(cumulative, q * total))][0] for q in qs]


class Recent:
    def __init__(self, bucket_s: float = 2.0, window_s: float = 300.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.bucket_s = bucket_s
        self.n_buckets = int(window_s / bucket_s)
        self._clock = clock
        self._buckets: deque[_Bucket] = deque(maxlen=self.n_buckets)
        # (time, seconds, weight): each request's TTFT (weight 1), each run of equal token gaps (weight: how many)
        self._ttft: deque[tuple[float, float, int]] = deque(maxlen=MAX_SAMPLES)
        self._tpot: deque[tuple[float, float, int]] = deque(maxlen=MAX_SAMPLES)

    def _now(self) -> _Bucket:
        start = self._clock() // self.bucket_s * self.bucket_s
        if not self._buckets or self._buckets[-1].start != start:
            self._buckets.append(_Bucket(start))
        return self._buckets[-1]

    def first_token(self, ttft_s: float) -> None:
        b = self._now()
        b.ttft_sum += ttft_s
        b.ttft_n += 1
        self._ttft.append((self._clock(), ttft_s, 1))

    def tokens(self, n: int, gaps: int = 0, gap_s: float = 0.0) -> None:
        """n tokens arrived, with `gaps` inter-token gaps of gap_s each among them."""
        b = self._now()
        b.tokens += n
        b.tpot_sum += gaps * gap_s
        b.tpot_n += gaps
        if gaps:
            self._tpot.append((self._clock(), gap_s, gaps))

    def finished(self) -> None:
        self._now().finished += 1

    def _summary(self, samples: deque, since: float) -> dict:
        """p50, p99 and the latest of the window's samples, in ms (None without any)."""
        while samples and samples[0][0] < since:
            samples.popleft()
        p50, p99 = quantiles((s, w) for _, s, w in samples)
        last = samples[-1][1] if samples else None
        return {name: (1000 * v if v is not None else None) for name, v in (("p50", p50), ("p99", p99), ("last", last))}

    def to_json(self) -> dict:
        """One point per bucket over the whole window, oldest first, empty buckets as zeros (None: no sample); and
        the window's TTFT and TPOT quantiles with their latest values (`summary`)."""
        now = self._clock() // self.bucket_s * self.bucket_s
        by_start = {b.start: b for b in self._buckets}
        points = []
        for i in range(self.n_buckets - 1, -1, -1):
            start = now - i * self.bucket_s
            b = by_start.get(start) or _Bucket(start)
            points.append({
                "t": start,
                "tokens_per_s": b.tokens / self.bucket_s,
                "finished": b.finished,
                "ttft_ms": 1000 * b.ttft_sum / b.ttft_n if b.ttft_n else None,
                "tpot_ms": 1000 * b.tpot_sum / b.tpot_n if b.tpot_n else None,
            })
        since = now - (self.n_buckets - 1) * self.bucket_s
        summary = {"ttft_ms": self._summary(self._ttft, since), "tpot_ms": self._summary(self._tpot, since)}
        return {"bucket_s": self.bucket_s, "points": points, "summary": summary}
