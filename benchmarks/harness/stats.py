"""Small statistics the reports share."""

from __future__ import annotations

import math
import statistics
from typing import Any


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile (0-1) by nearest rank: a value that was measured, never an interpolation."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def gpu_idle_frac(before: dict[str, Any], after: dict[str, Any]) -> float:
    """The GPU's idle share between decode steps (waiting for the host), from two ``llm.metrics()``."""
    idle = after["decode_gpu_idle_seconds_total"] - before["decode_gpu_idle_seconds_total"]
    busy = after["decode_gpu_busy_seconds_total"] - before["decode_gpu_busy_seconds_total"]
    return idle / max(idle + busy, 1e-9)
