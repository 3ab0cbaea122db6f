"""A server's side of overload, below HTTP: refusals at arrival, queue deadlines, Retry-After, stalled
streams.

The queue's bounds, its drain rates and the dropping of requests that cannot start by their deadline
live with the engine (``serving/admission.py``: one place that sees every arrival and every step, in
either engine mode), and its check is the exact one. But it runs between engine steps, and a step
with big prefills takes seconds, so a request refused there waits that long to hear so. This module
takes most refusals off the engine's path; ``entrypoints/openai/overload_http.py`` turns its decisions
and the engine's into HTTP (429 bodies, the ``X-Max-Queue-Delay`` header, the watched SSE response):

* ``ArrivalGate``, in the HTTP process, refuses a request at arrival, at once, from the queue the
  engine last published (``QueueState``: after every step and every arrival decision; the engine
  process sends it with its outputs) plus the requests sent since that the engine has not decided
  yet: past the bound on waiting requests or prompt tokens, or when the estimated queue wait does not
  fit ``DEADLINE_MARGIN`` of the request's time left. The published queue is taken to drain at its
  rates for the time since it was taken; requests sent since are behind it and have not started.
  What passes the gate goes to the engine, which decides exactly; both count their refusals in the
  same /metrics counters, by bound (the gate's also in ``requests_refused_http_total``);
* a request's queue deadline (``deadline_at``): ``--max-queue-delay`` and the request's own delay (the
  ``X-Max-Queue-Delay`` header; seconds, the smaller wins), counted from when the request reached the
  route;
* ``QueueFull`` (from the gate or the engine) and a request dropped from the queue for its deadline
  (``dropped``) become 429 ``rate_limit_error`` with a ``Retry-After`` header (whole seconds: the time
  the queue now takes to drain, from the engine's last state: ``queue_retry_after``). 429 rather than
  503: the server is up, this request came when it was full, and clients (the openai SDK among them)
  retry a 429 after Retry-After;
* a stream whose client stops reading: the engine never waits for a reader (outputs are paced, the
  request keeps running), but it would run to ``max_tokens`` for a client that may be gone without
  closing its connection. ``StallWatch`` aborts a stream's requests once one of its writes has not
  been taken for ``--stream-stall-timeout`` seconds; their KV is freed at once, and a client that
  comes back reads what was sent, a final chunk with finish_reason "abort" and ``[DONE]``.

No web framework here, and no HTTP error bodies (``prefixserve.protocols`` is above this layer).
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from prefixserve.outputs import RequestOutput
from prefixserve.serving.admission import (
    DEADLINE_REASON,
    AdmissionLimits,
    QueueFull,
    QueueState,
    refused_counter,
    retry_after_s,
    start_wait,
)
from prefixserve.serving.engine_thread import EngineLoop
from prefixserve.serving.slot_schedule import slot_wait
from prefixserve.serving.wait_error import deadline_missed

if TYPE_CHECKING:
    from prometheus_client import Counter

log = logging.getLogger(__name__)

STALL_S = 60.0  # default --stream-stall-timeout
RETRY_AFTER_MAX_S = 60
HTTP_REFUSED = "requests_refused_http_total"  # refusals at arrival decided here, not by the engine


@dataclass(frozen=True, slots=True)
class OverloadSettings:
    """``prefixserve serve``'s overload options. ``limits``: the waiting queue's bounds (None sizes one
    from the engine, 0 is unbounded); ``max_queue_delay``: seconds a request may wait before it starts
    (None: no deadline unless the request's header sets one); ``stream_stall_timeout``: seconds a
    stream's write may wait for its client before the stream's requests are aborted (None: never)."""

    limits: AdmissionLimits = field(default_factory=AdmissionLimits)
    max_queue_delay: float | None = None
    stream_stall_timeout: float | None = STALL_S

    def __post_init__(self) -> None:
        for name in ("max_queue_delay", "stream_stall_timeout"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a number of seconds > 0, got {value}")


def deadline_at(
    asked: str | None, max_queue_delay: float | None, arrival: float | None = None
) -> float | None:
    """The ``time.monotonic()`` by which a request must have started: ``arrival`` (default now: the
    route's start) plus the smaller of the server's ``max_queue_delay`` and the request's own
    ``asked`` delay (seconds, as the client wrote them; None: it asked none); None for neither.
    ValueError when ``asked`` is not a number of seconds > 0."""
    arrival = time.monotonic() if arrival is None else arrival
    delay = max_queue_delay
    if asked is not None:
        try:
            seconds = float(asked)
        except ValueError:
            seconds = math.nan
        if not (seconds > 0 and math.isfinite(seconds)):
            raise ValueError(f"a queue delay must be a number of seconds > 0, got {asked[:40]!r}")
        delay = seconds if delay is None else min(delay, seconds)
    return None if delay is None else arrival + delay


class ArrivalGate:
    """Refusals at arrival decided in the HTTP process, from the engine's last ``QueueState`` (read
    from ``loop.queue_state``) and the arrivals sent since that it has not decided yet. Thread-safe:
    the state is replaced whole by the thread that receives it, the rest is under a lock."""

    def __init__(self, loop: EngineLoop, clock: Callable[[], float] = time.monotonic) -> None:
        self.loop, self.clock = loop, clock
        self.counters: dict[str, int] = {
            **{refused_counter(b): 0 for b in ("requests", "tokens", "deadline")},
            HTTP_REFUSED: 0,
        }
        self._lock = threading.Lock()
        self._sent: dict[int, float] = {}  # arrival number -> prompt tokens it adds (estimated)
        self._sent_tokens = 0.0  # their sum
        self._last = 0  # the last arrival number given

    def check(self, deadline: float | None) -> None:
        """``admit``'s refusals that do not depend on the prompt (all but a token bound its tokens
        would pass), before the prompt is tokenized: a refused request costs the server no more."""
        self._decide(None, deadline, reserve=False)

    def admit(self, prompt_tokens: int | None, deadline: float | None) -> int | None:
        """Refuse a request (QueueFull, counted) or let it go to the engine: then its arrival number,
        to send with it (None while the engine publishes no state: nothing to go by).
        ``prompt_tokens``: its prompt's length, None if unknown here (its tokens then count 0)."""
        return self._decide(prompt_tokens, deadline, reserve=True)

    def _decide(self, prompt_tokens: int | None, deadline: float | None, reserve: bool) -> int | None:
        state = self.loop.queue_state
        if state is None:
            return None
        with self._lock:
            self._settle(state.decided)
            now = self.clock()
            waiting, tokens = self._queue_now(state, now)
            adds = (prompt_tokens or 0) * state.new_token_share
            # the slot schedule counts the published queue undrained: the slots freed since it was
            # taken went to the requests it held
            ahead = state.waiting + len(self._sent)
            slot = slot_wait(ahead, state.free_slots, state.free_at, now, state.request_rate)
            wait = start_wait(waiting, tokens, state.request_rate, state.token_rate, slot)
            count = math.ceil(waiting - 1e-9)
            if state.max_requests is not None and count >= state.max_requests:
                self._refuse(
                    "requests",
                    f"the server is at capacity: {count} requests are waiting (the bound is "
                    f"{state.max_requests})",
                    wait,
                )
            if state.max_tokens is not None and tokens > 0 and tokens + adds > state.max_tokens:
                self._refuse(
                    "tokens",
                    f"the server is at capacity: the waiting requests hold about {tokens:.0f} prompt "
                    f"tokens still to compute and this one adds about {adds:.0f} (the bound is "
                    f"{state.max_tokens})",
                    wait,
                )
            # where priorities order the queue, the requests ahead of this one are the engine's to count
            judged = deadline is not None and not state.priorities
            missed = deadline_missed(wait, deadline - now, state.slack, state.ratio) if judged else None
            if missed is not None:
                self._refuse("deadline", missed, wait)
            if not reserve:
                return None
            self._last += 1
            self._sent[self._last] = adds
            self._sent_tokens += adds
            return self._last

    def _settle(self, decided: int) -> None:
        """Forget the arrivals the engine has decided (numbers go up, so they lead ``_sent``)."""
        sent = self._sent
        while sent:
            first = next(iter(sent))
            if first > decided:
                break
            self._sent_tokens -= sent.pop(first)
        if not sent:
            self._sent_tokens = 0.0  # no float residue

    def _queue_now(self, state: QueueState, now: float) -> tuple[float, float]:
        """(waiting requests, their prompt tokens still to compute), estimated for ``now``: the
        published queue drained at its rates since it was taken, then the arrivals sent since, which
        the engine has not seen start."""
        elapsed = max(0.0, now - state.taken)
        waiting, tokens = float(state.waiting), float(state.waiting_tokens)
        if state.request_rate:
            waiting = max(0.0, waiting - elapsed * state.request_rate)
        if state.token_rate:
            tokens = max(0.0, tokens - elapsed * state.token_rate)
        return waiting + len(self._sent), tokens + self._sent_tokens

    def _refuse(self, bound: str, why: str, wait: float) -> None:
        self.counters[refused_counter(bound)] += 1
        self.counters[HTTP_REFUSED] += 1
        retry = retry_after_s(wait)
        raise QueueFull(f"{why}; retry after {retry} s", retry, bound)


def dropped(out: RequestOutput) -> bool:
    """Was this request dropped from the queue for its deadline (before it ran)?"""
    return out.finished and any(c.finish_reason == DEADLINE_REASON for c in out.outputs)


def queue_retry_after(loop: EngineLoop) -> int:
    """Whole seconds a request dropped from the queue for its deadline should wait before it comes
    back: the engine's last estimate of the queue's drain time, 1 to ``RETRY_AFTER_MAX_S``."""
    retry = int(loop.snapshot.get("queue_retry_after_seconds", 1))
    return max(1, min(RETRY_AFTER_MAX_S, retry))


class WatchedWrites(Protocol):
    """A stream ``StallWatch`` watches: when its pending write began (None: none pending), the engine
    requests it carries, and whether the watch has stalled it."""

    ids: list[str]
    writing_since: float | None  # the event loop's time
    stalled: bool


class StallWatch:
    """Aborts the requests of streams whose pending write has waited ``stall_s`` for its client.

    One task per event loop, alive while there are streams, looks at them every ``stall_s / 4``
    (at most every second): a stream costs two attribute writes per write, not a timer."""

    def __init__(self, loop: EngineLoop, stall_s: float, stalled: Counter) -> None:
        self.loop, self.stall_s, self.stalled = loop, stall_s, stalled
        self._streams: set[WatchedWrites] = set()
        self._task: asyncio.Task[None] | None = None

    def add(self, stream: WatchedWrites) -> None:
        self._streams.add(stream)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._watch())

    def discard(self, stream: WatchedWrites) -> None:
        self._streams.discard(stream)

    async def _watch(self) -> None:
        period = min(1.0, self.stall_s / 4)
        clock = asyncio.get_running_loop().time
        while self._streams:
            await asyncio.sleep(period)
            now = clock()
            for stream in list(self._streams):
                since = stream.writing_since
                if since is not None and not stream.stalled and now - since >= self.stall_s:
                    self._abort(stream, now - since)

    def _abort(self, stream: WatchedWrites, waited: float) -> None:
        stream.stalled = True
        self.stalled.inc()
        log.warning("a stream's client took nothing for %.1f s: aborting %s", waited, ", ".join(stream.ids))
        for rid in stream.ids:
            self.loop.abort(rid, report=True)  # the KV goes now; the final output waits for the client


__all__ = [
    "HTTP_REFUSED",
    "RETRY_AFTER_MAX_S",
    "STALL_S",
    "ArrivalGate",
    "OverloadSettings",
    "StallWatch",
    "WatchedWrites",
    "deadline_at",
    "dropped",
    "queue_retry_after",
]
