"""Python's cyclic GC thresholds for an engine process: passes rare enough not to stall decode steps."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

GC_THRESHOLD0 = 50_000  # allocations between young-generation collections (CPython's default: 700)


def tune_gc() -> None:
    """Make Python's cyclic GC rare enough that its passes do not stall decode steps.

    A pass visits every element of every list alive. The engine keeps token ids and positions in
    arrays (``sequence.TokenArray``), which a pass does not look inside, so a full pass is short; but
    a caller's lists (prompts held as lists, outputs' lists) are still walked: with CPython's default
    thresholds a pass ran every few decode steps (measured on the H200 host when the engine still
    used lists: 0.55 s of 1.45 s of host time over 38 steps). Raising the young-generation threshold
    makes every generation's passes ~70x rarer; cycles (a request and its sequences) are still
    collected. Nothing is frozen: a frozen object in a cycle would leak.
    """
    threshold0, threshold1, threshold2 = gc.get_threshold()
    gc.set_threshold(max(threshold0, GC_THRESHOLD0), threshold1, threshold2)


def watch_gc(observe: Callable[[float], object]) -> Callable[[], None]:
    """Call ``observe(seconds)`` after each cyclic GC pass of this process (a pass holds the GIL: every
    thread, the event loop and the engine's loop among them, waits it out); returns the function
    that stops watching."""
    began: list[float] = []

    def callback(phase: str, _info: dict[str, int]) -> None:
        if phase == "start":
            began.append(time.perf_counter())
        elif began:
            observe(time.perf_counter() - began.pop())

    gc.callbacks.append(callback)
    return lambda: gc.callbacks.remove(callback)


class GcPauses:
    """A process's GC passes as counters for a metrics snapshot (the engine process's: its snapshot is
    a dict of numbers that crosses the pipe)."""

    def __init__(self) -> None:
        self.passes = 0
        self.seconds = 0.0
        self.longest = 0.0
        self.unwatch = watch_gc(self.observe)

    def observe(self, seconds: float) -> None:
        self.passes += 1
        self.seconds += seconds
        self.longest = max(self.longest, seconds)

    def metrics(self) -> dict[str, float]:
        return {
            "engine_gc_passes_total": self.passes,
            "engine_gc_pause_seconds_total": self.seconds,
            "engine_gc_pause_longest_seconds": self.longest,
        }


__all__ = ["GC_THRESHOLD0", "GcPauses", "tune_gc", "watch_gc"]
