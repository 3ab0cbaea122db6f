"""The slot schedule (``serving/slot_schedule.py``): when the batch is full, a waiting request's start is
the time the running sequence ahead of it in finishing order frees its slot, predicted from each one's
tokens left (capped by the recent finished lengths when those stop early) and the step time. Checked on
fake sequences, then on the tiny dummy engine with a fake clock (the admission refuses at arrival what
the schedule says cannot start in time, where the drain rates knew nothing yet, and what it admits is
served, never dropped), then through the HTTP side's ``ArrivalGate``."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixserve.config import EngineConfig
from prefixserve.engine import Engine
from prefixserve.sampling.params import SamplingParams
from prefixserve.serving.admission import Admission, AdmissionLimits, QueueFull, QueueState
from prefixserve.serving.overload import ArrivalGate
from prefixserve.serving.slot_schedule import SlotSchedule, slot_wait


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def fake_seq(seq_id: int, made: int, max_tokens: int | None, prompt: int = 10) -> SimpleNamespace:
    return SimpleNamespace(
        seq_id=seq_id,
        num_tokens=prompt + made,
        num_prompt_tokens=prompt,
        is_finished=False,
        request=SimpleNamespace(params=SimpleNamespace(max_tokens=max_tokens)),
    )


def timed(schedule: SlotSchedule, step_s: float, now: float = 0.0) -> None:
    schedule.step_began(now - step_s, busy=True)
    schedule.step_began(now, busy=True)


def test_slot_wait_takes_the_slot_its_place_in_the_queue_gets() -> None:
    free_at = (10.5, 11.0, 13.0)
    assert slot_wait(0, 1, free_at, 10.0, None) is None  # a free slot waits for it
    assert slot_wait(2, 0, (), 10.0, 1.0) is None  # no schedule: the drain rates decide
    assert slot_wait(0, 0, free_at, 10.0, None) == pytest.approx(0.5)
    assert slot_wait(2, 1, free_at, 10.0, None) == pytest.approx(1.0)  # 2 ahead: the free one, 10.5
    assert slot_wait(2, 0, free_at, 14.0, None) == 0.0  # freed already
    assert slot_wait(4, 0, free_at, 10.0, 2.0) == pytest.approx(3.0 + 2 / 2.0)  # past it: the rate
    assert math.isinf(slot_wait(4, 0, free_at, 10.0, None) or 0.0)


@given(
    st.lists(st.floats(0.0, 100.0), min_size=1, max_size=40),
    st.floats(0.0, 60.0),
    st.integers(0, 8),
    st.floats(0.1, 50.0),
)
def test_slot_wait_never_decreases_with_the_queue_ahead(
    times: list[float], ahead: float, free: int, rate: float
) -> None:
    free_at = tuple(sorted(times))
    waits = [slot_wait(ahead + k, free, free_at, 5.0, rate) for k in range(0, 60, 3)]
    known = [0.0 if w is None else w for w in waits]
    assert all(b >= a for a, b in itertools.pairwise(known))
    assert all(w is None or w >= 0.0 for w in waits)


def test_the_schedule_predicts_from_tokens_left_and_the_step_time() -> None:
    schedule = SlotSchedule(max_num_seqs=4, max_model_len=100)
    timed(schedule, 0.05)
    assert schedule.step_s == pytest.approx(0.05)
    schedule.rebuild([fake_seq(1, 10, 30), fake_seq(2, 0, 8), fake_seq(3, 5, None)], now=0.0)
    assert schedule.free_slots == 1
    # 8 tokens left, then 20 left, then the context: 100 - 10 prompt - 5 made
    assert schedule.free_at == pytest.approx((0.4, 1.0, 85 * 0.05))
    schedule.step_began(5.0, busy=False)  # the engine went idle: the next interval is not a step
    schedule.step_began(50.0, busy=True)
    assert schedule.step_s == pytest.approx(0.05)


def test_sequences_that_stop_early_cap_the_tokens_left_of_the_running_ones() -> None:
    schedule = SlotSchedule(max_num_seqs=64, max_model_len=None)
    timed(schedule, 0.1)
    seqs = [fake_seq(i, 0, 1000) for i in range(20)]
    schedule.rebuild(seqs, now=0.0)
    assert schedule.free_at[0] == pytest.approx(100.0)  # 1000 tokens left, nothing learned yet
    for i, s in enumerate(seqs):  # they all stop early: 10..29 tokens
        s.num_tokens += 10 + i
        s.is_finished = True
    schedule.rebuild([fake_seq(100, 5, 1000), fake_seq(101, 40, 1000)], now=0.0)
    # the cap is the 90th percentile of 10..29, 28 tokens: 23 left, and at least one step for a
    # sequence already past it
    assert schedule.free_at == pytest.approx((0.1, 2.3))
    bound = SlotSchedule(max_num_seqs=64, max_model_len=None)  # these all ran to max_tokens
    timed(bound, 0.1)
    ran = [fake_seq(i, 0, 12) for i in range(20)]
    bound.rebuild(ran, now=0.0)
    for s in ran:
        s.num_tokens += 12
        s.is_finished = True
    bound.rebuild([fake_seq(100, 0, 500)], now=0.0)
    assert bound.free_at == pytest.approx((50.0,))  # max_tokens is the length: no cap


@pytest.fixture(scope="module")
def engine(tiny_config_path: Path) -> Iterator[Engine]:
    """Two slots: two requests run, the next ones wait for a slot."""
    config = EngineConfig(model=f"dummy:{tiny_config_path}", device="cpu", num_kv_blocks=128, max_num_seqs=2)
    engine = Engine(config, progress=False)
    yield engine
    engine.shutdown()


def add(
    engine: Engine, adm: Admission, rid: str, first: int, max_tokens: int, deadline: float | None
) -> None:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    prompt = list(range(first, first + 8))
    engine.add_request(rid, params=params, prompt_token_ids=prompt, admit=adm.gate(deadline))


def test_a_full_batch_refuses_at_arrival_what_cannot_get_a_slot_in_time(engine: Engine) -> None:
    clock = FakeClock()
    adm = Admission(engine, AdmissionLimits(max_waiting_requests=0, max_waiting_tokens=0), clock=clock)

    def step() -> list[str]:
        clock.now += 0.1  # a step every 0.1 s
        adm.before_step()
        return [o.request_id for o in engine.step() if o.finished]

    add(engine, adm, "long", 100, max_tokens=40, deadline=None)
    add(engine, adm, "short", 200, max_tokens=10, deadline=None)
    for _ in range(3):
        step()
    assert adm.rate is None  # the queue was never busy: the drain rates know nothing
    state = adm.state()
    assert state.free_slots == 0 and len(state.free_at) == 2
    # "short" has ~7 tokens left (0.7 s), "long" ~37 (3.7 s)
    with pytest.raises(QueueFull) as late:
        add(engine, adm, "hurried", 300, max_tokens=4, deadline=clock.now + 0.5)
    assert late.value.bound == "deadline"
    add(engine, adm, "next", 400, max_tokens=4, deadline=clock.now + 1.5)  # gets short's slot (0.7 s)
    with pytest.raises(QueueFull):  # behind "next": it waits for long's slot, ~3.7 s
        add(engine, adm, "after", 500, max_tokens=4, deadline=clock.now + 3.0)
    add(engine, adm, "patient", 600, max_tokens=4, deadline=clock.now + 6.5)  # 3.7 s fits 0.6 of it
    finished: list[str] = []
    for _ in range(100):
        if not engine.has_unfinished():
            break
        finished += step()
    step()
    assert sorted(finished) == ["long", "next", "patient", "short"]
    assert adm.counters["requests_dropped_deadline_total"] == 0
    assert adm.counters["requests_refused_deadline_total"] == 2
    # the two admitted with a deadline started, neither later than estimated by a quarter of it
    assert adm.counters["queue_starts_estimated_total"] == 2
    assert adm.counters["queue_starts_late_total"] == 0
    assert adm.counters["queue_wait_actual_seconds_total"] > 0
    assert engine.pool.num_used == 0


def test_the_gate_reads_the_published_schedule() -> None:
    clock = FakeClock(100.0)
    loop = SimpleNamespace(queue_state=None)
    gate = ArrivalGate(loop, clock=clock)  # type: ignore[arg-type]
    loop.queue_state = QueueState(
        taken=100.0, decided=0, waiting=1, waiting_tokens=0, request_rate=None, token_rate=None,
        new_token_share=1.0, max_requests=None, max_tokens=None, free_slots=0, free_at=(100.5, 102.0, 104.0),
    )  # fmt: skip
    with pytest.raises(QueueFull):  # one waiting takes the slot at 100.5; this one's is at 102.0
        gate.admit(10, clock.now + 2.0)
    assert gate.admit(10, clock.now + 3.4) == 1  # 2 s fits 0.6 of 3.4 s
    clock.now = 101.0  # the one sent is not decided: it takes 102.0, the next one 104.0
    with pytest.raises(QueueFull) as late:
        gate.admit(10, clock.now + 3.0)
    assert late.value.retry_after == 3
