"""The server's overload control at the engine's edge (``serving/admission.py``), driven step by step on
the tiny dummy model with a fake clock: the waiting queue's bounds refuse with QueueFull and count it,
shared prompt blocks are counted once, the wait is the slower of the request and prefill-token drains,
a request that cannot start by its deadline is dropped before it costs compute (before the deadline
once its place in the queue says so), nothing leaks, and the engine keeps serving. Then the HTTP side's
``ArrivalGate`` on fake published states and a fake clock. (Over HTTP: test_server_overload.py.)"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixserve.config import EngineConfig
from prefixserve.engine import Engine
from prefixserve.outputs import RequestOutput
from prefixserve.sampling.params import SamplingParams
from prefixserve.serving.admission import (
    DEADLINE_REASON,
    Admission,
    AdmissionLimits,
    QueueFull,
    QueueState,
    queue_wait,
)
from prefixserve.serving.overload import HTTP_REFUSED, ArrivalGate
from prefixserve.serving.wait_error import DEADLINE_MARGIN, StartLateness, WindowMax, deadline_missed


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def engine(tiny_config_path: Path) -> Iterator[Engine]:
    """One request runs at a time (max_num_seqs=1), so the next ones wait in the queue."""
    config = EngineConfig(model=f"dummy:{tiny_config_path}", device="cpu", num_kv_blocks=128, max_num_seqs=1)
    engine = Engine(config, progress=False)
    yield engine
    engine.shutdown()


def assert_pool_empty(engine: Engine) -> None:
    engine.pool.check_integrity()
    assert not engine.requests and not engine.scheduler.waiting and not engine.scheduler.running
    assert engine.pool.num_used == 0


def ids(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def add(
    engine: Engine,
    admission: Admission,
    rid: str,
    tokens: list[int],
    max_tokens: int = 4,
    deadline: float | None = None,
    arrival: int | None = None,
) -> None:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    admit = admission.gate(deadline, arrival)
    engine.add_request(rid, params=params, prompt_token_ids=tokens, admit=admit)


def step(engine: Engine, admission: Admission) -> list[RequestOutput]:
    """What a server's loop does: the admission's turn, then the engine's step."""
    admission.before_step()
    return engine.step()


def drain(engine: Engine, admission: Admission, clock: FakeClock | None = None) -> dict[str, RequestOutput]:
    finals: dict[str, RequestOutput] = {}
    for _ in range(500):
        if not engine.has_unfinished():
            break
        if clock is not None:
            clock.now += 0.01
        finals.update({o.request_id: o for o in step(engine, admission) if o.finished})
    step(engine, admission)  # the admission forgets what ended
    assert not engine.has_unfinished()
    return finals


def test_the_requests_bound_refuses_and_counts_and_the_engine_keeps_serving(engine: Engine) -> None:
    adm = Admission(engine, AdmissionLimits(max_waiting_requests=2, max_waiting_tokens=0))
    assert (adm.max_requests, adm.max_tokens) == (2, None)
    add(engine, adm, "a", ids(100, 20), max_tokens=8)
    step(engine, adm)  # a runs: the one slot is taken
    add(engine, adm, "b", ids(200, 20))
    add(engine, adm, "c", ids(300, 20))
    with pytest.raises(QueueFull) as refused:
        add(engine, adm, "d", ids(400, 20))
    assert refused.value.bound == "requests" and refused.value.retry_after >= 1
    assert "2 requests are waiting" in str(refused.value)
    assert "d" not in engine.requests and len(engine.scheduler.waiting) == 2
    assert adm.counters["requests_refused_queue_requests_total"] == 1
    finals = drain(engine, adm)
    assert {rid: o.outputs[0].finish_reason for rid, o in finals.items()} == dict.fromkeys("abc", "length")
    add(engine, adm, "d", ids(400, 20))  # the queue drained: taken now
    assert drain(engine, adm)["d"].outputs[0].finish_reason == "length"
    assert_pool_empty(engine)
    assert adm.metrics()["requests_refused_queue_requests_total"] == 1
    assert adm.waiting_tokens == 0 and not adm._claimed


def test_the_tokens_bound_counts_shared_and_cached_prompt_blocks_once(engine: Engine) -> None:
    adm = Admission(engine, AdmissionLimits(max_waiting_requests=0, max_waiting_tokens=100))
    b = ids(1000, 64)  # 3 full blocks can be shared (the last token is always computed)
    add(engine, adm, "a", ids(900, 20), max_tokens=8)
    step(engine, adm)
    add(engine, adm, "b", b)
    assert adm.waiting_tokens == 64
    add(engine, adm, "d", b[:48] + ids(3000, 20))  # shares b's first 3 blocks: 20 new tokens
    assert adm.waiting_tokens == 84
    with pytest.raises(QueueFull) as refused:
        add(engine, adm, "e", ids(4000, 17))  # 84 + 17 > 100
    assert refused.value.bound == "tokens" and "84 prompt tokens" in str(refused.value)
    assert adm.counters["requests_refused_queue_tokens_total"] == 1
    drain(engine, adm)
    assert adm.waiting_tokens == 0 and not adm._claimed
    # b's blocks are in the prefix cache now: a request starting with them adds only its own tokens
    add(engine, adm, "a2", ids(900, 20), max_tokens=8)
    step(engine, adm)
    add(engine, adm, "f", b[:48] + ids(5000, 30))
    assert adm.waiting_tokens == 30
    # an empty queue takes any request, however large: a bound never starves one big prompt
    drain(engine, adm)
    add(engine, adm, "big", ids(6000, 300))
    drain(engine, adm)
    assert_pool_empty(engine)


def test_the_books_follow_a_request_aborted_while_it_waits(engine: Engine) -> None:
    adm = Admission(engine, AdmissionLimits(max_waiting_requests=0, max_waiting_tokens=100))
    add(engine, adm, "a", ids(900, 20), max_tokens=8)
    step(engine, adm)
    add(engine, adm, "b", ids(11_000, 64))
    engine.abort("b", report=False)  # its client left; no step since
    add(engine, adm, "c", ids(12_000, 80))  # 64 + 80 would pass the bound: b no longer counts
    assert adm.waiting_tokens == 80 and adm.metrics()["waiting_prompt_tokens"] == 80
    drain(engine, adm)
    assert adm.metrics()["waiting_prompt_tokens"] == 0
    assert_pool_empty(engine)


def test_a_request_past_its_deadline_is_dropped_before_it_costs_compute(engine: Engine) -> None:
    clock = FakeClock()
    adm = Admission(engine, AdmissionLimits(), clock=clock)
    add(engine, adm, "a", ids(100, 20), max_tokens=12, deadline=clock.now + 0.5)
    step(engine, adm)  # a started: its deadline no longer applies
    computed = engine.counters["prompt_tokens_computed_total"]
    aborted = engine.counters["requests_aborted_total"]
    add(engine, adm, "b", ids(7000, 40), deadline=clock.now + 1.0)
    add(engine, adm, "c", ids(8000, 24))
    clock.now += 0.6
    assert not any(o.request_id == "b" for o in step(engine, adm))  # a (running) is past its deadline
    clock.now += 0.6
    outs = {o.request_id: o for o in step(engine, adm)}
    assert outs["b"].finished and outs["b"].outputs[0].finish_reason == DEADLINE_REASON
    assert outs["b"].outputs[0].token_ids == [] and "b" not in engine.requests
    assert adm.counters["requests_dropped_deadline_total"] == 1
    assert engine.counters["requests_aborted_total"] == aborted + 1
    finals = drain(engine, adm, clock)
    assert finals["a"].outputs[0].finish_reason == "length"
    assert finals["c"].outputs[0].finish_reason == "length"
    assert engine.counters["prompt_tokens_computed_total"] - computed == 24  # c's prompt, none of b's
    assert_pool_empty(engine)


def test_the_drain_rate_sets_retry_after_and_refuses_what_would_miss_its_deadline(engine: Engine) -> None:
    clock = FakeClock()
    adm = Admission(engine, AdmissionLimits(max_waiting_requests=0, max_waiting_tokens=0), clock=clock)
    assert adm.retry_after() == 1 and adm.queue_wait_estimate() == 0.0  # nothing measured yet
    for i in range(20):
        add(engine, adm, f"r{i}", ids(10_000 + 100 * i, 8), max_tokens=1)
    for _ in range(15):  # one request starts (and ends) per step, a step every 0.1 s: 10 per second
        clock.now += 0.1
        step(engine, adm)
    assert adm.rate is not None and adm.rate == pytest.approx(10.0, rel=0.15)
    assert adm.token_rate == pytest.approx(80.0, rel=0.15)  # 8-token prompts
    waiting = len(engine.scheduler.waiting)
    assert 3 <= waiting <= 7
    assert adm.queue_wait_estimate() == pytest.approx(waiting / adm.rate)
    with pytest.raises(QueueFull) as refused:  # the queue ahead takes ~0.5 s: a 0.2 s deadline is missed
        add(engine, adm, "late", ids(20_000, 8), max_tokens=1, deadline=clock.now + 0.2)
    assert refused.value.bound == "deadline"
    with pytest.raises(QueueFull):  # a deadline already past at arrival
        add(engine, adm, "past", ids(20_000, 8), max_tokens=1, deadline=clock.now - 1)
    assert adm.counters["requests_refused_deadline_total"] == 2
    wait = adm.queue_wait_estimate()
    with pytest.raises(QueueFull):  # the estimate fits the time left, but not its margin
        add(engine, adm, "close", ids(20_000, 8), max_tokens=1, deadline=clock.now + wait / 0.8)
    assert adm.counters["requests_refused_deadline_total"] == 3
    add(engine, adm, "ok", ids(21_000, 8), max_tokens=1, deadline=clock.now + 5.0, arrival=7)
    state = adm.state()
    assert (state.decided, state.waiting, state.waiting_tokens) == (7, waiting + 1, 8 * (waiting + 1))
    assert (state.request_rate, state.token_rate, state.max_requests) == (adm.rate, adm.token_rate, None)
    for i in range(30):
        add(engine, adm, f"s{i}", ids(30_000 + 100 * i, 8), max_tokens=1)
    waiting = len(engine.scheduler.waiting)
    assert adm.retry_after() == math.ceil(waiting / adm.rate) and adm.retry_after() > 1
    assert adm.metrics()["queue_wait_estimate_seconds"] == pytest.approx(waiting / adm.rate)
    finals = drain(engine, adm, clock)
    assert finals["ok"].outputs[0].finish_reason == "length"
    assert_pool_empty(engine)


def test_a_refused_prompt_cache_request_gives_its_module_blocks_back(engine: Engine) -> None:
    engine.register_schema(
        '<schema name="trips">You plan trips. <module name="paris">Paris is the capital of France, '
        "on the Seine, with museums and cafes and long walks by the river.</module></schema>"
    )
    used = engine.pool.num_used  # the schema's encoded module blocks

    def refuse(_: object) -> None:
        raise QueueFull("full", 1, "requests")

    with pytest.raises(QueueFull):
        engine.add_request("pml", '<prompt schema="trips"><paris/> Where first?</prompt>', admit=refuse)
    assert engine.pool.num_used == used and "pml" not in engine.requests
    engine.pool.check_integrity()
    engine.unregister_schema("trips")


def test_limits_are_checked_and_default_to_the_engine_size(engine: Engine) -> None:
    with pytest.raises(ValueError, match="max_waiting_tokens"):
        AdmissionLimits(max_waiting_tokens=-1)
    adm = Admission(engine)
    assert adm.max_requests == 4 * engine.config.max_num_seqs
    assert adm.max_tokens == 2 * engine.pool.num_blocks * engine.pool.block_size


def test_the_offline_api_queues_everything(tiny_config_path: Path) -> None:
    """No admission offline: far more prompts than a server's default bound (4 x max_num_seqs) all run."""
    from prefixserve import LLM

    llm = LLM(
        model=f"dummy:{tiny_config_path}", device="cpu", num_kv_blocks=64, max_num_seqs=1, progress=False
    )
    prompts = [{"prompt_token_ids": ids(100 * i + 1, 6)} for i in range(12)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True))
    assert [o.outputs[0].finish_reason for o in outs] == ["length"] * 12


def test_the_wait_is_the_slower_of_the_request_and_prefill_token_drains() -> None:
    assert queue_wait(10, 100, 5.0, 1000.0) == 2.0  # short prompts: the requests drain slower
    assert queue_wait(2, 10_000, 5.0, 1000.0) == 10.0  # a long prompt: its tokens do
    assert queue_wait(2, 10_000, 5.0, None) == 0.4  # a rate never measured says nothing
    assert queue_wait(3, 30, None, None) == 0.0
    assert queue_wait(3, 30, 0.0, 10.0) == math.inf and queue_wait(0, 0, 0.0, 0.0) == 0.0


def test_a_long_prompt_in_the_queue_refuses_what_a_request_count_would_admit(engine: Engine) -> None:
    clock = FakeClock()
    adm = Admission(engine, AdmissionLimits(max_waiting_requests=0, max_waiting_tokens=0), clock=clock)
    add(engine, adm, "a", ids(41_000, 8), max_tokens=2)
    step(engine, adm)  # a runs and holds the one slot
    add(engine, adm, "short", ids(41_500, 8), max_tokens=1)
    add(engine, adm, "long", ids(42_000, 400), max_tokens=1)
    adm.rate, adm.token_rate = 10.0, 80.0  # as measured (test_the_drain_rate_...): 8-token prompts
    assert 2 / adm.rate < DEADLINE_MARGIN * 2.0  # by requests alone, a 2 s deadline would be admitted
    assert adm.queue_wait_estimate() == pytest.approx(408 / 80.0)  # the long prompt's prefill: 5.1 s
    with pytest.raises(QueueFull) as refused:
        add(engine, adm, "late", ids(43_000, 8), max_tokens=1, deadline=clock.now + 2.0)
    assert refused.value.bound == "deadline" and refused.value.retry_after == 6
    drain(engine, adm, clock)
    assert_pool_empty(engine)


def test_a_waiting_request_that_cannot_start_in_time_is_dropped_before_its_deadline(engine: Engine) -> None:
    clock = FakeClock()
    adm = Admission(engine, AdmissionLimits(max_waiting_requests=0, max_waiting_tokens=0), clock=clock)
    add(engine, adm, "a", ids(44_000, 8), max_tokens=2)
    step(engine, adm)  # a runs and holds the one slot
    add(engine, adm, "w0", ids(45_000, 8), max_tokens=1)
    add(engine, adm, "w1", ids(45_100, 8), max_tokens=1)
    adm.rate = 2.0  # as if measured: the 2 ahead of x take 1 s
    deadline = clock.now + 3.0
    add(engine, adm, "x", ids(46_000, 8), max_tokens=1, deadline=deadline)  # 1 s fits 0.6 of 3 s
    add(engine, adm, "y", ids(46_500, 8), max_tokens=1, deadline=clock.now + 30.0)
    clock.now += 0.5
    adm.before_step()  # x: 2.5 s left, starts in ~1 s
    assert "x" in engine.requests
    clock.now += 2.0
    adm.before_step()  # 0.5 s left, starts in ~1 s: not yet twice its time left, kept
    assert "x" in engine.requests
    clock.now += 0.1
    adm.before_step()  # 0.4 s left: its start estimate (>= 1 s: no starts lately) is past twice that
    assert clock.now < deadline and "x" not in engine.requests and "y" in engine.requests
    assert adm.counters["requests_dropped_deadline_total"] == 1
    assert list(adm.lateness.samples) == [pytest.approx(2.6 - 1.0)]  # x never started: as late as it waited
    outs = {o.request_id: o for o in engine.step()}
    assert outs["x"].outputs[0].finish_reason == DEADLINE_REASON and outs["x"].outputs[0].token_ids == []
    finals = {**{r: o for r, o in outs.items() if o.finished}, **drain(engine, adm, clock)}
    assert {finals[r].outputs[0].finish_reason for r in ("a", "w0", "w1", "y")} == {"length"}
    assert_pool_empty(engine)


# ---- the HTTP side: ArrivalGate ------------------------------------------------------------------
def published(**kw: float | int | None) -> QueueState:
    """A state as the engine would publish it: 3 waiting holding 300 tokens, 1 request/s and 100
    prefill tokens/s, half of a new prompt to compute, bounds of 5 requests and 1000 tokens."""
    base = dict(
        taken=1000.0,
        decided=0,
        waiting=3,
        waiting_tokens=300,
        request_rate=1.0,
        token_rate=100.0,
        new_token_share=0.5,
        max_requests=5,
        max_tokens=1000,
    )
    return QueueState(**{**base, **kw})  # type: ignore[arg-type]


def test_the_gate_refuses_at_arrival_from_the_published_queue_and_what_was_sent_since() -> None:
    clock = FakeClock()
    loop = SimpleNamespace(queue_state=None)
    gate = ArrivalGate(loop, clock=clock)  # type: ignore[arg-type]
    assert gate.admit(100, clock.now + 0.001) is None  # nothing published: the engine decides
    loop.queue_state = published()
    assert gate.admit(100, None) == 1 and gate.admit(None, None) == 2  # sent, not decided yet
    with pytest.raises(QueueFull) as full:  # 3 published + 2 sent: at the bound of 5
        gate.admit(100, None)
    assert full.value.bound == "requests" and "5 requests are waiting" in str(full.value)
    assert full.value.retry_after == 5  # 5 requests at 1 per second
    loop.queue_state = published(decided=2, waiting=5, waiting_tokens=350)  # the engine took them
    with pytest.raises(QueueFull):
        gate.admit(100, None)
    clock.now += 2.0  # the published queue drained 2 requests (and 200 tokens) since it was taken
    assert gate.admit(100, None) == 3
    loop.queue_state = published(decided=3, waiting_tokens=990, taken=clock.now)
    with pytest.raises(QueueFull) as full:  # 990 + half of 100 > 1000
        gate.admit(100, None)
    assert full.value.bound == "tokens"
    assert gate.admit(10, None) == 4  # 990 + 5 fits
    # deadlines: 3 + 1 sent requests at 1/s = 4 s; the tokens, (990 + 5) / 100 = 9.95 s, are slower
    loop.queue_state = published(decided=4, taken=clock.now)  # 3 requests, 300 tokens: 3 s
    with pytest.raises(QueueFull) as late:
        gate.admit(10, clock.now + 3.9)  # 3 s > 0.6 of 3.9 s
    assert late.value.bound == "deadline" and late.value.retry_after == 3
    with pytest.raises(QueueFull):  # the same, before the prompt is tokenized
        gate.check(clock.now + 3.9)
    gate.check(clock.now + 5.1)  # passes, and sends nothing: the next number is still 5
    assert gate.admit(10, clock.now + 5.1) == 5  # 3 s fits 0.6 of 5.1 s
    with pytest.raises(QueueFull):
        gate.admit(10, clock.now - 0.1)  # no time left
    loop.queue_state = published(decided=5, taken=clock.now, waiting=1, waiting_tokens=1000, max_tokens=None)
    with pytest.raises(QueueFull):  # one long prompt ahead: 10 s of prefill, though 1 s by requests
        gate.admit(10, clock.now + 10.0)
    assert gate.counters == {
        "requests_refused_queue_requests_total": 2,
        "requests_refused_queue_tokens_total": 1,
        "requests_refused_deadline_total": 4,
        HTTP_REFUSED: 7,
    }
    # once priorities order the queue, a whole-queue wait says nothing of one request's: the
    # deadline is the engine's to judge (those sorting ahead of it), the bounds still the gate's
    loop.queue_state = published(decided=6, taken=clock.now, priorities=True)
    assert gate.admit(10, clock.now + 0.5) == 6
    loop.queue_state = published(decided=7, taken=clock.now, waiting=5, priorities=True)
    with pytest.raises(QueueFull):
        gate.admit(10, None)


# ---- the estimate's measured error: slack at arrival ------------------------------------------------
def test_start_lateness_is_the_largest_recent_late_start() -> None:
    late = StartLateness()
    for _ in range(StartLateness.MIN_SAMPLES - 1):
        late.add(5.0)
    assert late.slack() == 0.0  # too few starts to say anything
    late = StartLateness()
    for i in range(400):
        late.add(-1.0 if i % 2 else i / 1000)  # early starts count as on time
    assert late.slack() == pytest.approx(0.398)
    for _ in range(StartLateness.WINDOW):  # the window moves on: old lateness is forgotten
        late.add(0.01)
    assert late.slack() == pytest.approx(0.01)


def test_slack_refuses_what_the_estimate_alone_would_admit() -> None:
    assert deadline_missed(1.75, 3.0) is None  # 1.75 s fits 0.6 of 3 s
    assert deadline_missed(1.9, 3.0) is not None  # the margin alone
    why = deadline_missed(1.75, 3.0, slack=1.3)
    assert why is not None and "allowing 1.3 s" in why
    assert deadline_missed(1.75, 3.0, slack=1.25) is None
    clock = FakeClock()
    loop = SimpleNamespace(queue_state=published(taken=clock.now, max_requests=None, max_tokens=None))
    gate = ArrivalGate(loop, clock=clock)  # type: ignore[arg-type]
    assert gate.admit(10, clock.now + 5.1) == 1  # 3 s ahead fits 0.6 of 5.1 s
    loop.queue_state = published(taken=clock.now, decided=1, max_requests=None, max_tokens=None, slack=2.5)
    with pytest.raises(QueueFull) as late:  # 3 s + 2.5 s of recent lateness > 5.1 s
        gate.admit(10, clock.now + 5.1)
    assert late.value.bound == "deadline"


def test_lateness_ratio_scales_with_the_estimate() -> None:
    """A start 1 s late on a 2 s estimate makes a 4 s estimate 2 s late, not 1 s: the ratio is the
    largest actual / estimated wait, over estimates long enough to say so."""
    late = StartLateness()
    for _ in range(StartLateness.MIN_SAMPLES):
        late.add(0.3, 0.1)  # short estimates: a step's latency, no ratio sample
    assert late.slack() == pytest.approx(0.3) and late.ratio() == 1.0
    for i in range(StartLateness.MIN_SAMPLES):
        late.add(1.0 if i == 7 else -0.2, 2.0)  # one 1.5x start, the rest early (ratio 1)
    assert late.ratio() == pytest.approx(1.5) and late.slack() == pytest.approx(1.0)
    for _ in range(StartLateness.WINDOW):  # the window moves on
        late.add(0.1, 1.0)
    assert late.ratio() == pytest.approx(1.1) and late.slack() == pytest.approx(0.1)


@pytest.mark.parametrize(
    ("wait", "left", "slack", "ratio", "admitted"),
    [
        (1.75, 3.0, 1.25, 1.0, True),  # the absolute slack alone fits exactly
        (1.75, 3.0, 1.0, 1.6, True),  # 2.8 s scaled
        (1.75, 3.0, 1.0, 1.75, False),  # 3.06 s scaled
        (2.1, 3.0, 0.0, 1.0, False),  # the margin: the H200's drops (1.9-2.2 s estimates, ~1.5x late)
        (0.2, 3.0, 1.0, 10.0, True),  # a short wait: the slack dominates, the ratio fits
        (1.0, 3.0, 0.0, 3.5, False),  # the ratio alone
    ],
)
def test_deadline_check_allows_for_both_errors(
    wait: float, left: float, slack: float, ratio: float, admitted: bool
) -> None:
    why = deadline_missed(wait, left, slack, ratio)
    assert (why is None) == admitted
    if not admitted and wait * ratio > wait + slack:
        assert f"{ratio:.2f}x the estimate" in why


def test_http_gate_applies_the_published_ratio() -> None:
    clock = FakeClock()
    base = dict(taken=clock.now, max_requests=None, max_tokens=None)
    loop = SimpleNamespace(queue_state=published(**base))
    gate = ArrivalGate(loop, clock=clock)  # type: ignore[arg-type]
    assert gate.admit(10, clock.now + 5.1) == 1  # 3 s ahead fits 0.6 of 5.1 s
    loop.queue_state = published(**base, decided=1, slack=0.5, ratio=1.8)
    with pytest.raises(QueueFull) as late:  # 3 s + 0.5 s fits, 3 s x 1.8 does not
        gate.admit(10, clock.now + 5.1)
    assert late.value.bound == "deadline" and "1.80x the estimate" in str(late.value)


def test_the_engine_publishes_the_lateness_of_its_starts(engine: Engine) -> None:
    """Requests admitted with an estimate and started later than it make the slack the engine publishes
    and applies to its own arrival check."""
    clock = FakeClock()
    adm = Admission(engine, AdmissionLimits(max_waiting_requests=0, max_waiting_tokens=0), clock=clock)
    for i in range(60):
        add(engine, adm, f"r{i}", ids(10_000 + 100 * i, 8), max_tokens=1, deadline=clock.now + 100.0)
    while engine.has_unfinished():  # the estimates were 0 (nothing measured): every start is late
        clock.now += 0.1
        step(engine, adm)
    slack = adm.state().slack
    assert slack > 1.0 and adm.metrics()["queue_wait_slack_seconds"] == slack
    assert adm.metrics()["queue_wait_slack_ratio"] == adm.state().ratio >= 1.0
    assert adm.counters["queue_starts_estimated_total"] == 60
    wait = adm.queue_wait_estimate()
    with pytest.raises(QueueFull) as refused:  # an empty queue, but less time left than the slack
        add(engine, adm, "tight", ids(20_000, 8), max_tokens=1, deadline=clock.now + slack / 2 + wait)
    assert "recent error" in str(refused.value)
    assert_pool_empty(engine)


@given(st.lists(st.floats(0, 10), max_size=60), st.integers(1, 8))
def test_window_max_is_the_largest_of_the_last_values(values: list[float], size: int) -> None:
    window = WindowMax(size)
    for i, v in enumerate(values):
        window.append(v)
        last = values[max(0, i + 1 - size) : i + 1]
        assert list(window) == last and window.max() == max(last)
