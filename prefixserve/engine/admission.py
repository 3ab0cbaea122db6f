"""Overload control for a server's engine: a bounded waiting queue and queue deadlines.

An engine that queues every request lets the queue grow without bound under overload: every request
then waits longer than its client will, and nobody is told. So the loop that drives a server's engine
(``entrypoints/openai/engine_thread.py``, or the engine process) keeps an ``Admission`` beside the
engine. ``Engine.add_request(admit=...)`` asks it about each processed request before queueing it:
past a bound it raises ``QueueFull`` (the server answers 429 with ``Retry-After``) and nothing is
queued. Before each step, ``before_step`` drops the waiting requests whose deadline has passed (they
finish with ``finish_reason`` ``DEADLINE_REASON``, before any compute), notes which ones started, and
measures how fast the queue drains. The offline API never has one (it queues everything by design),
and nothing here runs inside ``Engine.step``.

Bounds (``AdmissionLimits``; None: sized from the engine, 0: unbounded):

- waiting requests: sequences in the scheduler's waiting queue (a request waits as one sequence
  until its prompt is computed), by default ``WAITING_REQUESTS_PER_SEQ`` x ``max_num_seqs``;
- waiting prompt tokens: prompt tokens the waiting requests still have to compute, by default
  ``WAITING_TOKENS_PER_POOL`` x the KV pool's tokens. A request's leading full blocks that are in the
  prefix cache, or in the prompt of a request waiting ahead of it, are not counted: 256 questions
  about one 16K-token document are one document of work, not 256 (an estimate: a block that a
  running request is computing right now counts until it is indexed).

A request is always admitted into an empty queue, so a bound never starves one large prompt.

Deadlines are absolute ``time.monotonic()`` times (CLOCK_MONOTONIC: one clock for the processes of a
host). A request that has a deadline is also refused at once when the queue ahead of it would not
drain before that deadline at the rate it drained lately (``queue_wait_estimate``): at 2x the
sustainable rate, clients hear "no" at arrival instead of after waiting their whole deadline. The
estimate must fit in ``DEADLINE_MARGIN`` of the time left: the drain rate is a smoothed past rate and
lags a queue that grows (an H100 run of ``benchmarks/overload.py`` at 2x its ladder's top rate, with
the whole time left as the bound, refused 34 requests at arrival and dropped 41 at their deadline).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prefixserve.sequence import Request, SeqStatus

WAITING_REQUESTS_PER_SEQ = 4  # default bound on waiting requests: this many times max_num_seqs
WAITING_TOKENS_PER_POOL = 2.0  # default bound on waiting prompt tokens: this many KV pools' worth
DEADLINE_REASON = "deadline"  # finish_reason of a request dropped from the queue past its deadline
RATE_WINDOW_S = 1.0  # the drain rate is sampled over this much time with a non-empty queue
RATE_SMOOTHING = 0.3  # weight of the newest sample in the drain rate's moving average
RETRY_AFTER_MAX_S = 60  # Retry-After never says more than this
DEADLINE_MARGIN = (
    0.75  # a request is admitted if its estimated queue wait is within this share of its time left
)

COUNTERS = (
    "requests_refused_queue_requests_total",
    "requests_refused_queue_tokens_total",
    "requests_refused_deadline_total",
    "requests_dropped_deadline_total",
)


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    """A server's bounds on its waiting queue: None sizes one from the engine, 0 leaves it unbounded."""

    max_waiting_requests: int | None = None
    max_waiting_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_waiting_requests", "max_waiting_tokens"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0 (0: unbounded), got {value}")


class QueueFull(Exception):
    """A request refused at the queue. ``bound``: "requests", "tokens" or "deadline";
    ``retry_after``: whole seconds the client should wait before trying again. (Its args are its
    fields, so it pickles across the engine process's pipe.)"""

    def __init__(self, message: str, retry_after: int, bound: str) -> None:
        super().__init__(message, retry_after, bound)
        self.message, self.retry_after, self.bound = message, retry_after, bound

    def __str__(self) -> str:
        return self.message


@dataclass(slots=True, eq=False)
class _Waiting:
    """An admitted request that has not started: what it adds to the queue's work."""

    req: Request
    tokens: int  # prompt tokens it still has to compute (leading shared blocks not counted)
    digests: list[bytes]  # its prompt's full-block digests, claimed while it waits
    deadline: float | None


def _bound(value: int | None, default: int) -> int | None:
    if value is None:
        return max(1, default)
    return value or None  # 0: unbounded


class Admission:
    """The queue's bounds, deadlines and drain rate for one engine; used on the engine's thread."""

    def __init__(
        self,
        engine: Any,
        limits: AdmissionLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        limits = limits or AdmissionLimits()
        self.engine = engine
        self.clock = clock
        pool_tokens = engine.pool.num_blocks * engine.pool.block_size
        self.max_requests = _bound(
            limits.max_waiting_requests, WAITING_REQUESTS_PER_SEQ * engine.config.max_num_seqs
        )
        self.max_tokens = _bound(limits.max_waiting_tokens, int(WAITING_TOKENS_PER_POOL * pool_tokens))
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.waiting_tokens = 0  # sum of ``tokens`` over ``_waiting``
        self.rate: float | None = None  # requests started per second while the queue was not empty
        self._waiting: dict[str, _Waiting] = {}  # admitted, not started, in arrival order
        self._claimed: dict[bytes, int] = {}  # digest -> how many waiting prompts hold that block
        self._last_tick = clock()
        self._busy = False  # the queue had requests at the last tick
        self._window_s = 0.0
        self._window_starts = 0
        self._starts = 0  # starts seen by ``admit`` since the last ``before_step``
        self._looked_at = -1  # engine steps at the last look

    # ---- at arrival (Engine.add_request's ``admit``) ----------------------------------------------
    def gate(self, deadline: float | None = None) -> Callable[[Request], None]:
        """The ``admit`` check for one request: admits it (with its deadline) or raises QueueFull."""
        return lambda req: self.admit(req, deadline)

    def admit(self, req: Request, deadline: float | None = None) -> None:
        """Take ``req`` into the queue's books, or raise QueueFull naming the bound it would pass."""
        waiting = len(self.engine.scheduler.waiting)
        looked = self._stale(waiting)  # a step ran, or a request left, since the last look
        if looked:
            self._starts += self._look()
        if self.max_requests is not None and waiting >= self.max_requests:
            self._refuse(
                "requests",
                f"the server is at capacity: {waiting} requests are waiting (the bound is "
                f"{self.max_requests})",
            )
        tokens, digests = self._new_work(req)
        if self._over_tokens(tokens) and not looked:  # a refusal goes by fresh books only
            self._starts += self._look()
            tokens, digests = self._new_work(req)
        if self._over_tokens(tokens):
            self._refuse(
                "tokens",
                f"the server is at capacity: the waiting requests hold {self.waiting_tokens} prompt "
                f"tokens still to compute and this one adds {tokens} (the bound is {self.max_tokens})",
            )
        if deadline is not None:
            left = deadline - self.clock()
            wait = self.queue_wait_estimate(waiting)
            if left <= 0 or wait > DEADLINE_MARGIN * left:
                self._refuse(
                    "deadline",
                    f"the request would wait about {wait:.1f} s in the queue, past its queue deadline "
                    f"({max(left, 0.0):.1f} s left)",
                )
        self._waiting[req.request_id] = _Waiting(req, tokens, digests, deadline)
        self.waiting_tokens += tokens
        claimed = self._claimed
        for d in digests:
            claimed[d] = claimed.get(d, 0) + 1

    def _over_tokens(self, tokens: int) -> bool:
        """Would ``tokens`` more take a non-empty queue past its bound of prompt tokens?"""
        held = self.waiting_tokens
        return self.max_tokens is not None and held > 0 and held + tokens > self.max_tokens

    def _stale(self, waiting: int) -> bool:
        """Are the books behind the queue? After a step (it may have started requests), or when
        they hold more requests than wait (some were aborted since)."""
        if not self._waiting:
            return False
        return len(self._waiting) > waiting or self._looked_at != self.engine.counters["steps_total"]

    def _new_work(self, req: Request) -> tuple[int, list[bytes]]:
        """Prompt tokens ``req`` adds to the queue, and the digests of its full prompt blocks (computed
        now rather than at its admission to a step; the sequence keeps them)."""
        seq = req.sequences[0]
        blocks = self.engine.blocks
        bs = blocks.block_size
        start = len(req.modules.blocks) if req.modules is not None else 0  # Prompt Cache: computed
        digests = blocks.digests(seq, blocks.cacheable_blocks(seq))[start:]
        claimed, cached = self._claimed, self.engine.pool.cached_block
        known = 0
        for d in digests:
            if d not in claimed and cached(d) is None:
                break
            known += 1
        return max(0, seq.num_tokens - (start + known) * bs), digests

    def _refuse(self, bound: str, why: str) -> None:
        key = "deadline" if bound == "deadline" else f"queue_{bound}"
        self.counters[f"requests_refused_{key}_total"] += 1
        retry = self.retry_after()
        raise QueueFull(f"{why}; retry after {retry} s", retry, bound)

    # ---- between steps ---------------------------------------------------------------------------
    def before_step(self) -> None:
        """Drop the waiting requests past their deadline (their final outputs come from the next
        ``step``), forget the ones that started or ended, and sample the drain rate."""
        now = self.clock()
        started, self._starts = self._starts + self._look(now), 0
        self._sample_rate(now, started)

    def _look(self, now: float | None = None) -> int:
        """Forget the requests that started or ended since the last look; with ``now``, also drop
        those past their deadline. Returns how many started."""
        self._looked_at = self.engine.counters["steps_total"]
        if not self._waiting:
            return 0
        requests = self.engine.requests
        started = 0
        done: list[tuple[str, _Waiting]] = []
        expired: list[tuple[str, _Waiting]] = []
        for rid, w in self._waiting.items():
            req = w.req
            if requests.get(rid) is not req:  # ended while waiting (aborted), or ran and finished
                done.append((rid, w))
                started += req.first_token_time is not None
            elif req.sequences[0].status is not SeqStatus.WAITING:
                done.append((rid, w))
                started += 1
            elif now is not None and w.deadline is not None and now >= w.deadline:
                expired.append((rid, w))
        for rid, w in done:
            self._forget(rid, w)
        for rid, w in expired:
            self._forget(rid, w)
            self.engine.abort(rid, report=True, reason=DEADLINE_REASON)
            self.counters["requests_dropped_deadline_total"] += 1
        return started

    def _forget(self, rid: str, w: _Waiting) -> None:
        del self._waiting[rid]
        self.waiting_tokens -= w.tokens
        claimed = self._claimed
        for d in w.digests:
            left = claimed[d] - 1
            if left:
                claimed[d] = left
            else:
                del claimed[d]

    def _sample_rate(self, now: float, started: int) -> None:
        """Requests started per second, over time the queue was not empty (an idle engine drains
        nothing and says nothing about the rate)."""
        if self._busy:
            self._window_s += now - self._last_tick
            self._window_starts += started
            if self._window_s >= RATE_WINDOW_S:
                sample = self._window_starts / self._window_s
                self.rate = sample if self.rate is None else self.rate + RATE_SMOOTHING * (sample - self.rate)
                self._window_s, self._window_starts = 0.0, 0
        self._last_tick = now
        self._busy = bool(self._waiting)

    # ---- estimates and metrics ---------------------------------------------------------------------
    def queue_wait_estimate(self, waiting: int | None = None) -> float:
        """Seconds until ``waiting`` requests (default: the queue now) have started, at the recent rate;
        0 before any rate was measured, inf when the queue did not drain at all lately."""
        if waiting is None:
            waiting = len(self.engine.scheduler.waiting)
        if not waiting or self.rate is None:
            return 0.0
        return waiting / self.rate if self.rate > 0 else math.inf

    def retry_after(self) -> int:
        """Whole seconds for Retry-After: the time the queue now takes to drain, in [1, 60]."""
        wait = self.queue_wait_estimate()
        return RETRY_AFTER_MAX_S if math.isinf(wait) else max(1, min(RETRY_AFTER_MAX_S, math.ceil(wait)))

    def metrics(self) -> dict[str, float]:
        """Counters and gauges for the server's /metrics (merged into the engine's snapshot)."""
        if len(self._waiting) > len(self.engine.scheduler.waiting):  # some left since the last look
            self._starts += self._look()
        wait = self.queue_wait_estimate()
        return {
            **self.counters,
            "waiting_prompt_tokens": self.waiting_tokens,
            "queue_wait_estimate_seconds": wait if not math.isinf(wait) else float(RETRY_AFTER_MAX_S),
            "queue_retry_after_seconds": self.retry_after(),
            "max_waiting_requests": self.max_requests or 0,
            "max_waiting_tokens": self.max_tokens or 0,
        }


__all__ = [
    "DEADLINE_REASON",
    "Admission",
    "AdmissionLimits",
    "QueueFull",
]
