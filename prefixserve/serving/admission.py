"""Overload control for a server's engine: a bounded waiting queue and queue deadlines.

An engine that queues every request lets the queue grow without bound under overload: every request
then waits longer than its client will, and nobody is told. So the loop that drives a server's engine
(``serving/engine_thread.py``, or the engine process) keeps an ``Admission`` beside the
engine. It is the authoritative check: ``Engine.add_request(admit=...)`` asks it about each processed
request before queueing it; past a bound it raises ``QueueFull`` (the server answers 429 with
``Retry-After``) and nothing is queued. Before each step, ``before_step`` drops the waiting requests
that cannot start by their deadline (they finish with ``finish_reason`` ``DEADLINE_REASON``, before any
compute), notes which ones started, and measures how fast the queue drains. The offline API never has
one (it queues everything by design), and nothing here runs inside ``Engine.step``.

Arrival checks here run between engine steps, and a step with big prefills can take seconds: a request
refused here hears so only then. So the loop publishes the queue (``state``: a ``QueueState``) after
every step and every arrival decision, and the HTTP process refuses most requests itself, at once, from
the latest one (``serving/overload.py``, ``ArrivalGate``); what passes it is still checked
here, and this check is what makes the bounds exact.

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
host). The queue's wait is estimated from two drain rates, each measured over time the queue was not
empty and smoothed: requests started per second and prefill tokens computed per second; the wait is
the slower of (waiting requests / request rate) and (waiting prompt tokens / token rate), so a queue of
long prompts is not taken for a queue of short ones (``queue_wait``). A request that has a deadline is
refused at arrival when the queue ahead of it would not drain in ``DEADLINE_MARGIN`` of its time left:
the rates are smoothed past rates and lag a queue that grows (an H100 run of ``benchmarks/overload.py``
at 2x its ladder's top rate, with the whole time left as the bound, refused 34 requests at arrival and
dropped 41 at their deadline). A waiting request is dropped before its deadline once the estimated
start of its place in the queue (the requests and tokens ahead of it) is ``HOPELESS_FACTOR`` times its
time left: the margins lean towards refusing at arrival, where the client can go elsewhere at once,
and towards keeping a request already queued, which may still make it (each waiting request is
looked at every step: with the bound at 4/3 of the time left, an H100 overload run at twice its
sustainable rate dropped ~6% of the requests it admitted while its mean estimate was within 5% of
the mean actual wait).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from prefixserve.sequence import Request, SeqStatus
from prefixserve.serving.slot_schedule import SlotSchedule, slot_wait
from prefixserve.serving.wait_error import DEADLINE_MARGIN, StartLateness, deadline_missed

log = logging.getLogger(__name__)

WAITING_REQUESTS_PER_SEQ = 4  # default bound on waiting requests: this many times max_num_seqs
WAITING_TOKENS_PER_POOL = 2.0  # default bound on waiting prompt tokens: this many KV pools' worth
DEADLINE_REASON = "deadline"  # finish_reason of a request dropped from the queue for its deadline
RATE_WINDOW_S = 1.0  # the drain rates are sampled over this much time with a non-empty queue
RATE_SMOOTHING = 0.3  # weight of the newest sample in the drain rates' moving averages
SHARE_SMOOTHING = 0.1  # weight of each new prompt in the share of prompt tokens left to compute
RETRY_AFTER_MAX_S = 60  # Retry-After never says more than this

COUNTERS = (
    "requests_refused_queue_requests_total",
    "requests_refused_queue_tokens_total",
    "requests_refused_deadline_total",
    "requests_dropped_deadline_total",
    # the wait estimate checked against the starts: what tells an operator (and the overload
    # benchmark) whether refusals at arrival can be trusted
    "queue_starts_estimated_total",
    "queue_wait_estimated_seconds_total",
    "queue_wait_actual_seconds_total",
    "queue_starts_late_total",
)
# a waiting request is dropped before its deadline only once its estimated start is this many times
# its time left: each waiting request is looked at every step, and a noisy estimate looked at that
# often would drop, now and then, one that starts in time (a drop is a late refusal either way)
HOPELESS_FACTOR = 2.0
LATE_SHARE = 0.25  # a start later than estimated by this share of the queue deadline counts as late


def refused_counter(bound: str) -> str:
    """The counter of refusals at arrival at ``bound`` ("requests", "tokens" or "deadline")."""
    return (
        "requests_refused_deadline_total" if bound == "deadline" else f"requests_refused_queue_{bound}_total"
    )


def queue_wait(requests: float, tokens: float, request_rate: float | None, token_rate: float | None) -> float:
    """Seconds until ``requests`` holding ``tokens`` prompt tokens still to compute have started: the
    slower of the two drains (short prompts drain by requests, long ones by prefill tokens). A part
    whose rate was never measured says nothing (0); work at a rate of 0 is inf."""
    wait = 0.0
    for work, rate in ((requests, request_rate), (tokens, token_rate)):
        if work > 0 and rate is not None:
            wait = max(wait, work / rate if rate > 0 else math.inf)
    return wait


def start_wait(
    requests: float, tokens: float, request_rate: float | None, token_rate: float | None, slot: float | None
) -> float:
    """Seconds until a request behind ``requests`` waiting ones holding ``tokens`` starts. ``slot``:
    when it gets a batch slot (``slot_schedule.slot_wait``), None when a free one waits for it; with
    a slot time, that replaces the request drain rate (the schedule knows when sequences end)."""
    if slot is None:
        return queue_wait(requests, tokens, request_rate, token_rate)
    return max(slot, queue_wait(0, tokens, None, token_rate))


def retry_after_s(wait: float) -> int:
    """Whole seconds for Retry-After from a queue wait, in [1, ``RETRY_AFTER_MAX_S``]."""
    return RETRY_AFTER_MAX_S if math.isinf(wait) else max(1, min(RETRY_AFTER_MAX_S, math.ceil(wait)))


class QueueState(NamedTuple):
    """The waiting queue as the engine saw it at ``taken``: what the HTTP process needs to refuse at
    arrival without waiting for the engine (``ArrivalGate``). A tuple of numbers, so it crosses the
    engine process's pipe cheaply, with each step's outputs."""

    taken: float  # time.monotonic() when it was taken
    decided: int  # the highest arrival number (``Admission.admit``'s ``arrival``) decided by then
    waiting: int  # sequences in the scheduler's waiting queue
    waiting_tokens: int  # prompt tokens the waiting requests still have to compute
    request_rate: float | None  # requests started per second of a non-empty queue (None: unmeasured)
    token_rate: float | None  # prefill tokens computed per second of a non-empty queue
    new_token_share: float  # the share of a new prompt's tokens that is not cached or queued already
    max_requests: int | None  # the bounds (None: unbounded)
    max_tokens: int | None
    free_slots: int = 0  # batch slots free when it was taken
    free_at: tuple[float, ...] = ()  # when the running sequences free theirs (``SlotSchedule``)
    slack: float = 0.0  # seconds added to a wait estimate at arrival (``StartLateness``)
    ratio: float = 1.0  # the factor on a wait estimate at arrival (``StartLateness``)
    # a request with a priority of its own was admitted: the queue's order is not arrival's, so a
    # wait estimate over the whole queue says nothing of one request's (the engine's books decide)
    priorities: bool = False


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
    admitted: float = 0.0  # when it was admitted (the admission's clock)
    estimate: float | None = None  # the queue wait estimated then (with a deadline only)
    ahead: int = 0  # requests waiting ahead of it then


def _bound(value: int | None, default: int) -> int | None:
    if value is None:
        return max(1, default)
    return value or None  # 0: unbounded


def _smooth(old: float | None, sample: float) -> float:
    return sample if old is None else old + RATE_SMOOTHING * (sample - old)


class Admission:
    """The queue's bounds, deadlines and drain rates for one engine; used on the engine's thread."""

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
        self.slots = SlotSchedule(engine.config.max_num_seqs, getattr(engine, "max_model_len", None))
        self.lateness = StartLateness()  # the wait estimate's recent error: slack for arrivals
        self._slots_at = -1  # engine steps when ``slots`` was rebuilt
        self.waiting_tokens = 0  # sum of ``tokens`` over ``_waiting``
        self.rate: float | None = None  # requests started per second while the queue was not empty
        self.token_rate: float | None = None  # prefill tokens computed per second, likewise
        self.new_token_share = 1.0  # smoothed share of a new prompt's tokens it adds to the queue
        self.decided = 0  # the highest arrival number seen (``admit``'s ``arrival``)
        self._waiting: dict[str, _Waiting] = {}  # admitted, not started, in arrival order
        self._priorities = False  # a request with a priority other than 0 was admitted
        self._claimed: dict[bytes, int] = {}  # digest -> how many waiting prompts hold that block
        self._last_tick = clock()
        self._last_computed = self._computed()
        self._busy = False  # the queue had requests at the last tick
        self._window_s = 0.0
        self._window_starts = 0
        self._window_tokens = 0
        self._starts = 0  # starts seen by ``admit`` since the last ``before_step``
        self._looked_at = -1  # engine steps at the last look

    # ---- at arrival (Engine.add_request's ``admit``) ----------------------------------------------
    def gate(self, deadline: float | None = None, arrival: int | None = None) -> Callable[[Request], None]:
        """The ``admit`` check for one request: admits it (with its deadline) or raises QueueFull.
        ``arrival``: the number the HTTP process gave it (``QueueState.decided`` acknowledges it)."""
        self.arrived(arrival)
        return lambda req: self.admit(req, deadline)

    def arrived(self, arrival: int | None) -> None:
        """Note that the engine has decided (or will, before the next ``state``) arrival ``arrival``."""
        if arrival is not None and arrival > self.decided:
            self.decided = arrival

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
        prompt = req.sequences[0].num_tokens
        if prompt > 0:
            self.new_token_share += SHARE_SMOOTHING * (min(1.0, tokens / prompt) - self.new_token_share)
        if self._over_tokens(tokens):
            self._refuse(
                "tokens",
                f"the server is at capacity: the waiting requests hold {self.waiting_tokens} prompt "
                f"tokens still to compute and this one adds {tokens} (the bound is {self.max_tokens})",
            )
        now, estimate = self.clock(), None
        if deadline is not None:  # under the priority policy only those sorting before it are ahead
            behind = []
            if self._priorities or req.priority != 0:  # (first come first served: the whole queue)
                behind = [w for w in self._waiting.values() if w.req.priority > req.priority]
            ahead_tokens = self.waiting_tokens - sum(w.tokens for w in behind)
            estimate = self._wait(waiting - len(behind), ahead_tokens, now)
            late = self.lateness
            missed = deadline_missed(estimate, deadline - now, late.slack(), late.ratio())
            if missed is not None:
                self._refuse("deadline", missed)
        self._priorities = self._priorities or req.priority != 0
        self._waiting[req.request_id] = _Waiting(req, tokens, digests, deadline, now, estimate, waiting)
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
        start = len(req.modules.digests) if req.modules is not None else 0  # Prompt Cache: computed
        digests = blocks.digests(seq, blocks.cacheable_blocks(seq))[start:]
        claimed, cached = self._claimed, self.engine.pool.cached_block
        known = 0
        for d in digests:
            if d not in claimed and cached(d) is None:
                break
            known += 1
        return max(0, seq.num_tokens - (start + known) * bs), digests

    def _refuse(self, bound: str, why: str) -> None:
        self.counters[refused_counter(bound)] += 1
        retry = self.retry_after()
        raise QueueFull(f"{why}; retry after {retry} s", retry, bound)

    # ---- between steps ---------------------------------------------------------------------------
    def before_step(self) -> None:
        """Drop the waiting requests that cannot start by their deadline (their final outputs come
        from the next ``step``), forget the ones that started or ended, and sample the drain rates."""
        now = self.clock()
        sched = self.engine.scheduler
        self.slots.step_began(now, busy=bool(sched.running or sched.waiting))
        started, self._starts = self._starts + self._look(now), 0
        self._sample_rate(now, started)

    def _look(self, now: float | None = None) -> int:
        """Forget the requests that started or ended since the last look; with ``now``, also drop
        those that cannot start by their deadline (``_hopeless``). Returns how many started."""
        self._looked_at = self.engine.counters["steps_total"]
        if not self._waiting:
            return 0
        requests = self.engine.requests
        started = 0
        ahead = ahead_tokens = 0  # still waiting, ahead of the one looked at
        done: list[tuple[str, _Waiting]] = []
        expired: list[tuple[str, _Waiting, int]] = []  # with the requests then ahead of it
        books = self._waiting.items()
        if self._priorities:  # the queue's order: priority, then arrival (scheduler/policy.py)
            books = sorted(books, key=lambda item: (item[1].req.priority, item[1].req.arrival_time))
        for rid, w in books:
            req = w.req
            if requests.get(rid) is not req:  # ended while waiting (aborted), or ran and finished
                done.append((rid, w))
                if req.first_token_time is not None:  # it started (and ended) since the last look
                    started += 1
                    self._check_estimate(w, self.clock() if now is None else now)
            elif req.sequences[0].status is not SeqStatus.WAITING:
                done.append((rid, w))
                started += 1
                self._check_estimate(w, self.clock() if now is None else now)
            elif (
                now is not None
                and w.deadline is not None
                and self._hopeless(w.deadline - now, ahead, ahead_tokens, now)
            ):
                expired.append((rid, w, ahead))
            else:
                ahead += 1
                ahead_tokens += w.tokens
        for rid, w in done:
            self._forget(rid, w)
        for rid, w, before in expired:
            self._forget(rid, w)
            waited = self.clock() - w.admitted
            if w.estimate is not None and not math.isinf(w.estimate):  # at least this late
                self.lateness.add(waited - w.estimate, w.estimate)
            log.info(
                "dropped %s from the queue for its deadline after %.2f s: %d waited ahead of it at "
                "admission, estimated wait %s s (slack now %.2f s); %d still ahead",
                rid, waited, w.ahead,
                "-" if w.estimate is None else f"{w.estimate:.2f}", self.lateness.slack(), before,
            )  # fmt: skip
            self.engine.abort(rid, report=True, reason=DEADLINE_REASON)
            self.counters["requests_dropped_deadline_total"] += 1
        return started

    def _check_estimate(self, w: _Waiting, now: float) -> None:
        """Count a started request's estimated wait against its actual one."""
        if w.estimate is None or math.isinf(w.estimate) or w.deadline is None:
            return
        c, actual = self.counters, now - w.admitted
        c["queue_starts_estimated_total"] += 1
        c["queue_wait_estimated_seconds_total"] += w.estimate
        c["queue_wait_actual_seconds_total"] += actual
        self.lateness.add(actual - w.estimate, w.estimate)
        if actual - w.estimate > LATE_SHARE * (w.deadline - w.admitted):
            c["queue_starts_late_total"] += 1

    def _hopeless(self, left: float, ahead: int, ahead_tokens: int, now: float) -> bool:
        """Can a waiting request with ``left`` seconds to its deadline, behind ``ahead`` requests
        holding ``ahead_tokens``, no longer start in time? Past its deadline, or its estimated start
        is ``HOPELESS_FACTOR`` times the time left (an estimate that is inf, a rate of 0, drops nothing:
        it says the queue stalled lately, not when this request starts)."""
        if left <= 0:
            return True
        start = self._wait(ahead, ahead_tokens, now)
        return not math.isinf(start) and start > HOPELESS_FACTOR * left

    def _wait(self, ahead: int, ahead_tokens: float, now: float) -> float:
        """Estimated seconds from ``now`` until a request behind ``ahead`` waiting requests holding
        ``ahead_tokens`` starts (``start_wait`` with the slot schedule)."""
        slots = self._schedule(now)
        slot = slot_wait(ahead, slots.free_slots, slots.free_at, now, self.rate)
        return start_wait(ahead, ahead_tokens, self.rate, self.token_rate, slot)

    def _schedule(self, now: float) -> SlotSchedule:
        """The slot schedule, rebuilt once per engine step."""
        steps = self.engine.counters["steps_total"]
        if steps != self._slots_at:
            self._slots_at = steps
            self.slots.rebuild(self.engine.scheduler.running, now)
        return self.slots

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

    def _computed(self) -> int:
        return int(self.engine.counters["prompt_tokens_computed_total"])

    def _sample_rate(self, now: float, started: int) -> None:
        """Requests started and prefill tokens computed per second, over time the queue was not empty
        (an idle engine drains nothing and says nothing about the rates)."""
        computed = self._computed()
        if self._busy:
            self._window_s += now - self._last_tick
            self._window_starts += started
            self._window_tokens += computed - self._last_computed
            if self._window_s >= RATE_WINDOW_S:
                self.rate = _smooth(self.rate, self._window_starts / self._window_s)
                self.token_rate = _smooth(self.token_rate, self._window_tokens / self._window_s)
                self._window_s, self._window_starts, self._window_tokens = 0.0, 0, 0
        self._last_tick, self._last_computed = now, computed
        self._busy = bool(self._waiting)

    # ---- estimates, the published state and metrics --------------------------------------------------
    def queue_wait_estimate(self, waiting: int | None = None) -> float:
        """Seconds until ``waiting`` requests (default: the queue now) and the prompt tokens waiting
        have started, at the recent rates (``queue_wait``); 0 for an empty queue or before any rate
        was measured, inf when the queue did not drain at all lately."""
        if waiting is None:
            waiting = self._refresh()
        if not waiting:
            return 0.0
        return self._wait(waiting, self.waiting_tokens, self.clock())

    def retry_after(self) -> int:
        """Whole seconds for Retry-After: the time the queue now takes to drain, in [1, 60]."""
        return retry_after_s(self.queue_wait_estimate())

    def _refresh(self) -> int:
        """Bring the books up to the queue (a step may have started some); returns its length."""
        waiting = len(self.engine.scheduler.waiting)
        if self._stale(waiting):
            self._starts += self._look()
        return waiting

    def state(self) -> QueueState:
        """The queue now, for the HTTP process (published after every step and arrival decision)."""
        waiting = self._refresh()
        now = self.clock()
        slots = self._schedule(now)
        return QueueState(
            now,
            self.decided,
            waiting,
            self.waiting_tokens,
            self.rate,
            self.token_rate,
            self.new_token_share,
            self.max_requests,
            self.max_tokens,
            slots.free_slots,
            slots.free_at,
            self.lateness.slack(),
            self.lateness.ratio(),
            self._priorities,
        )

    def metrics(self) -> dict[str, float]:
        """Counters and gauges for the server's /metrics (merged into the engine's snapshot)."""
        wait = self.queue_wait_estimate()  # the books brought up to the queue first
        return {
            **self.counters,
            "waiting_prompt_tokens": self.waiting_tokens,
            "queue_wait_estimate_seconds": wait if not math.isinf(wait) else float(RETRY_AFTER_MAX_S),
            "queue_retry_after_seconds": self.retry_after(),
            "queue_wait_slack_seconds": self.lateness.slack(),
            "queue_wait_slack_ratio": self.lateness.ratio(),
            "queue_drain_requests_per_second": self.rate or 0.0,
            "queue_drain_prompt_tokens_per_second": self.token_rate or 0.0,
            "max_waiting_requests": self.max_requests or 0,
            "max_waiting_tokens": self.max_tokens or 0,
        }


__all__ = [
    "DEADLINE_MARGIN",
    "DEADLINE_REASON",
    "Admission",
    "AdmissionLimits",
    "QueueFull",
    "QueueState",
    "queue_wait",
    "refused_counter",
    "retry_after_s",
    "start_wait",
]
