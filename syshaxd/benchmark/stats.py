"""Summary statistics for latency samples: mean, median, p90, p99 and extremes, without numpy."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["percentile", "summarize", "SUMMARY_KEYS"]

SUMMARY_KEYS = ("mean", "median", "p90", "p99", "min", "max", "stdev", "count")


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of already sorted values, interpolated linearly (numpy's default)."""
    if not sorted_values:
        return math.nan
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile: q={q} is not allowed; it must be within 0..100")
    rank = (len(sorted_values) - 1) * q / 100.0
    low = math.floor(rank)
    high = math.ceil(rank)
    if low == high:
        return float(sorted_values[low])
    fraction = rank - low
    return float(sorted_values[low] + (sorted_values[high] - sorted_values[low]) * fraction)


def summarize(values: Sequence[float]) -> dict[str, float | int | None]:
    """Mean, median, p90, p99, min, max, stdev and count of values; None for each figure when empty.

    None rather than NaN so that the JSON report stays valid JSON.
    """
    data = sorted(v for v in values if v is not None and not math.isnan(v))
    if not data:
        return {key: (0 if key == "count" else None) for key in SUMMARY_KEYS}
    n = len(data)
    mean = math.fsum(data) / n
    variance = math.fsum((v - mean) ** 2 for v in data) / (n - 1) if n > 1 else 0.0
    return {
        "mean": mean,
        "median": percentile(data, 50),
        "p90": percentile(data, 90),
        "p99": percentile(data, 99),
        "min": data[0],
        "max": data[-1],
        "stdev": math.sqrt(variance),
        "count": n,
    }
