"""The wait estimate's measured error: how much later than estimated recent queued requests
started, and the arrival check that allows for it (``serving/admission.py`` in the engine's loop,
``serving/overload.py`` in the HTTP process)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

# admitted if the estimated queue wait is within this share of the time left: a floor under the
# measured error below, which learns only from starts it has seen (an H200 run at 2x overload had one
# stretch start 15 requests 1.4-1.6x later than their 1.9-2.2 s estimates, all at once, after ~50 s of
# estimates within 1.35x; 0.75 admitted them, 0.6 would not have)
DEADLINE_MARGIN = 0.6


def deadline_missed(wait: float, left: float, slack: float = 0.0, ratio: float = 1.0) -> str | None:
    """Why a request that would wait ``wait`` s with ``left`` s to its queue deadline is refused at
    arrival, or None if it is not: the estimate must fit ``DEADLINE_MARGIN`` of the time left, and
    the time left itself both with ``slack`` added (how much later than estimated recent requests
    started) and scaled by ``ratio`` (their largest actual / estimated wait): ``StartLateness``."""
    if left > 0 and wait <= DEADLINE_MARGIN * left and wait + slack <= left and wait * ratio <= left:
        return None
    spread = []
    if slack > 0:
        spread.append(f"{slack:.1f} s")
    if ratio > 1 and wait * ratio > wait + slack:
        spread.append(f"{ratio:.2f}x the estimate")
    allowing = f", allowing {' or '.join(spread)} for the estimate's recent error" if spread else ""
    return (
        f"the request would wait about {wait:.1f} s in the queue, past its queue deadline "
        f"({max(left, 0.0):.1f} s left{allowing})"
    )


class WindowMax:
    """The last ``size`` values appended and their largest, kept as they come: a deque of the values
    that can still be a window's largest (each larger than every later one), so ``max`` is the head
    and an append costs O(1) amortised, where ``max()`` over the window cost ~80 us at 2,048 values,
    once an engine step that started a request."""

    def __init__(self, size: int) -> None:
        self.values: deque[float] = deque(maxlen=size)
        self._tops: deque[tuple[int, float]] = deque()  # (append number, value), values decreasing
        self._appended = 0

    def append(self, value: float) -> None:
        at, size, tops = self._appended, self.values.maxlen or 0, self._tops
        self._appended += 1
        while tops and tops[-1][1] <= value:
            tops.pop()
        tops.append((at, value))
        if tops[0][0] <= at - size:  # one value leaves the window an append: at most the head
            tops.popleft()
        self.values.append(value)

    def __len__(self) -> int:
        return len(self.values)

    def __iter__(self) -> Iterator[float]:
        return iter(self.values)

    def max(self) -> float:
        """The window's largest value (it must not be empty)."""
        return self._tops[0][1]


class StartLateness:
    """How much later than estimated the recent queued requests started: the slack an arrival's
    estimate needs so that what is admitted starts before its deadline.

    The slot schedule is right on average, but a stretch of slow steps starts a run of requests late
    together: admitted near the margin, those ran into their queue deadline and were dropped after
    waiting it out (a refusal, but not one at once). The largest lateness of the last ``WINDOW``
    starts is the slack both the engine's check and the HTTP gate add to the estimate
    (``deadline_missed``); a request dropped for its deadline adds how late it already was (it never
    starts, and leaving it out would hide exactly the tail that matters). A high quantile instead of
    the largest (the 99.5th) still let 1% of the refusals at 2x overload come as drops after waiting
    (docs/benchmarks/overload.md).

    Seconds alone do not carry across machines: a queue twice as long is late by about twice as
    much, and a faster GPU holds longer queues at the same deadline (an H200 run dropped 39 requests
    admitted at 1.9-2.2 s estimates with 0.9-1.0 s of slack: the bound exactly). So the window also
    keeps the largest ratio of actual to estimated wait over starts whose estimate was at least
    ``RATIO_MIN_ESTIMATE`` (a short estimate's lateness is a step's latency, not a share of it), and
    an arrival's estimate must fit its time left scaled by that too."""

    WINDOW = 2048  # ~40 s of starts at an 8B model's overload rates on one H200
    MIN_SAMPLES = 32  # fewer starts say nothing yet: no slack
    RATIO_MIN_ESTIMATE = 0.5  # seconds: shorter estimates add no ratio sample

    def __init__(self) -> None:
        self.samples = WindowMax(self.WINDOW)
        self.ratios = WindowMax(self.WINDOW)
        self._slack = 0.0
        self._ratio = 1.0
        self._stale = False

    def add(self, late: float, estimate: float = 0.0) -> None:
        """A start ``late`` s after its ``estimate`` (negative: early, kept as 0)."""
        late = max(0.0, late)
        self.samples.append(late)
        if estimate >= self.RATIO_MIN_ESTIMATE:
            self.ratios.append(1.0 + late / estimate)
        self._stale = True

    def _update(self) -> None:
        if self._stale:
            self._stale = False
            self._slack = self.samples.max() if len(self.samples) >= self.MIN_SAMPLES else 0.0
            self._ratio = self.ratios.max() if len(self.ratios) >= self.MIN_SAMPLES else 1.0

    def slack(self) -> float:
        """Seconds added to an estimate: the largest recent lateness."""
        self._update()
        return self._slack

    def ratio(self) -> float:
        """The factor on an estimate: the largest recent actual / estimated wait (>= 1)."""
        self._update()
        return self._ratio


__all__ = ["DEADLINE_MARGIN", "StartLateness", "WindowMax", "deadline_missed"]
