"""When the running sequences will leave their batch slots: the wait of a request that needs one.

Once the batch is full (``max_num_seqs`` sequences running), a waiting request starts when a running
sequence finishes and frees its slot. A drain rate (requests started per second, smoothed) says that
only on average and late: under a growing queue it lags, admits requests that then miss their
deadline and are dropped after waiting, which is the late refusal a client cannot act on. The engine
knows more: each running sequence has at most ``max_tokens`` tokens left, one a step, and a step takes
about the recent step time (the median of the last ``STEPS_KEPT`` intervals between steps: one step
that compiles a kernel must not move every estimate). So ``SlotSchedule`` predicts, after every step,
the time each running sequence frees its slot (``free_at``, ascending); the request with ``k``
requests waiting ahead of it takes the ``(k - free slots)``-th of them (``slot_wait``).

A sequence that may stop early (EOS, a stop string) frees its slot sooner than its ``max_tokens``
says, and clients often ask for far more tokens than they use. So a sequence's tokens left are also
capped by the recent finished sequences' lengths (``TYPICAL_QUANTILE`` of the last ``LENGTHS_KEPT``),
unless nearly all of those ran to their ``max_tokens`` (then the bound is the length). The schedule is
an estimate for admission, never a promise: the engine's exact books decide, and a request that
misses is still dropped before its deadline.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

LENGTHS_KEPT = 256  # finished sequences whose output lengths cap a running one's tokens left
TYPICAL_QUANTILE = 0.9  # the cap: this quantile of those lengths
BOUND_SHARE = 0.9  # when this share of them ran to max_tokens, a sequence's bound is its length
STEPS_KEPT = 32  # the step time is the median of this many recent intervals between steps
STEP_GAP_S = 5.0  # a longer interval between steps is idle time, not a step


def slot_wait(
    ahead: float, free_slots: int, free_at: Sequence[float], now: float, request_rate: float | None
) -> float | None:
    """Seconds from ``now`` until a request with ``ahead`` requests waiting before it gets a batch slot,
    from a schedule taken when ``free_slots`` slots were free and the running sequences were to free
    theirs at ``free_at`` (ascending): None when a free slot waits for it (the batch is not what
    holds it back), or with no schedule (no step timed yet, nothing running: the drain rates decide).
    Past the schedule, the slots that requests not yet running free come at ``request_rate`` (inf
    without one)."""
    k = math.ceil(ahead - 1e-9) - free_slots
    if k < 0 or not free_at:
        return None
    if k < len(free_at):
        return max(0.0, free_at[k] - now)
    if not request_rate:
        return math.inf
    return max(0.0, free_at[-1] - now) + (k - len(free_at) + 1) / request_rate


class SlotSchedule:
    """The running sequences' predicted slot-free times, rebuilt once per engine step."""

    def __init__(self, max_num_seqs: int, max_model_len: int | None) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.step_s: float | None = None  # seconds per engine step while it has work (recent median)
        self._steps: deque[float] = deque(maxlen=STEPS_KEPT)
        self.free_at: tuple[float, ...] = ()  # ascending monotonic times
        self.free_slots = max_num_seqs
        self._lengths: deque[tuple[int, bool]] = deque(maxlen=LENGTHS_KEPT)  # (output tokens, hit bound)
        self._cap: float | None = None  # the typical-length cap now (None: none yet, or bound is length)
        self._running: dict[int, Any] = {}  # seq_id -> Sequence at the last rebuild
        self._last_step: float | None = None  # when the last step began, if the engine had work then

    def step_began(self, now: float, busy: bool) -> None:
        """Note a step's start; the interval since the last one (both with work) is a step's time."""
        last = self._last_step
        if last is not None and 0.0 < now - last < STEP_GAP_S:
            # a median, not a mean: one step that compiles a kernel takes seconds, and a mean would
            # then push every slot's time out and refuse (or drop) what the next steps serve in time
            self._steps.append(now - last)
            self.step_s = statistics.median(self._steps)
        self._last_step = now if busy else None

    def rebuild(self, running: Iterable[Any], now: float) -> None:
        """Predict the running sequences' slot-free times from now; note the ones that finished."""
        seqs = {s.seq_id: s for s in running}
        ended = [s for sid, s in self._running.items() if sid not in seqs and s.is_finished]
        if ended:
            for s in ended:
                out = s.num_tokens - s.num_prompt_tokens
                self._lengths.append((out, out >= self._bound(s)))
            self._cap = self._typical_cap()
        self._running = seqs
        self.free_slots = max(0, self.max_num_seqs - len(seqs))
        step = self.step_s
        if step is None or not seqs:
            self.free_at = ()
            return
        cap = self._cap
        times = []
        for s in seqs.values():
            made = s.num_tokens - s.num_prompt_tokens
            left = float(self._bound(s) - made)
            if cap is not None:
                left = min(left, max(1.0, cap - made))
            times.append(now + max(1.0, left) * step)
        times.sort()
        self.free_at = tuple(times)

    def _bound(self, seq: Any) -> int:
        """Most output tokens ``seq`` can make: its max_tokens, or up to the context length."""
        bound = seq.request.params.max_tokens
        if bound is None:
            ctx = self.max_model_len
            return max(1, ctx - seq.num_prompt_tokens) if ctx else 1 << 30
        return bound

    def _typical_cap(self) -> float | None:
        lengths = self._lengths
        if not lengths or sum(hit for _, hit in lengths) >= BOUND_SHARE * len(lengths):
            return None
        ordered = sorted(n for n, _ in lengths)
        return float(ordered[min(len(ordered) - 1, int(TYPICAL_QUANTILE * len(ordered)))])


__all__ = ["SlotSchedule", "slot_wait"]
