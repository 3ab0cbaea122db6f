"""A server process trims its heap only when idle after work, at most once per interval, and never
where a CPU engine keeps its freed memory on purpose (``serving/host_trim.py``)."""

from __future__ import annotations

import asyncio

import pytest

from prefixserve.serving.host_trim import IdleTrim, glibc_trim, trim_when_idle
from prefixserve.worker import cpu_malloc


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def no_kept_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_malloc, "_applied", False)


def test_trims_when_idle_after_work_at_most_once_per_interval(no_kept_memory: None) -> None:
    calls, clock = [], Clock()
    trim = IdleTrim(min_interval_s=1.0, trim=lambda: calls.append(clock.now), clock=clock)
    assert not trim.idle()  # nothing done yet
    trim.busy()
    assert trim.idle() and calls == [0.0]
    assert not trim.idle()  # no work since
    trim.busy()
    clock.now = 0.5
    assert not trim.idle()  # too soon
    clock.now = 1.5
    assert trim.idle() and calls == [0.0, 1.5] and trim.trims == 2


def test_never_where_the_cpu_engine_keeps_freed_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_malloc, "_applied", True)
    calls: list[int] = []
    trim = IdleTrim(trim=lambda: calls.append(1))
    trim.busy()
    assert not trim.idle() and not calls


def test_glibc_trim_runs() -> None:
    fn = glibc_trim()
    if fn is None:
        pytest.skip("not glibc")
    fn()


def test_the_http_task_trims_once_the_requests_are_done(no_kept_memory: None) -> None:
    calls: list[int] = []
    trim = IdleTrim(min_interval_s=0.0, trim=lambda: calls.append(1), collect=lambda: None)
    state = {"in_flight": 2, "requests": 0.0}

    async def scenario() -> None:
        task = asyncio.create_task(
            trim_when_idle(
                lambda: state["in_flight"], lambda: state["requests"], trim, period=0.01, observe=took.append
            )
        )
        await asyncio.sleep(0.05)
        assert not calls  # busy all along
        state.update(in_flight=0, requests=2.0)
        await asyncio.sleep(0.05)
        task.cancel()

    took: list[float] = []
    asyncio.run(scenario())
    assert len(calls) == 1  # once after the work, not again while nothing happens
    assert len(took) == 1 and took[0] >= 0.0  # its time, for /metrics


def test_the_server_metrics_time_this_process_gc_passes() -> None:
    import gc

    from prefixserve.entrypoints.openai.metrics import ServerMetrics

    metrics = ServerMetrics(dict)
    unwatch = metrics.watch_gc()
    try:
        gc.collect()
    finally:
        unwatch()
    gc.collect()  # not counted: no longer watched
    count = metrics.registry.get_sample_value("prefixserve_http_gc_pause_seconds_count")
    assert count == 1.0


def test_idle_frees_finished_requests_cycles_before_the_trim(no_kept_memory: None) -> None:
    """A finished request and its sequence reference each other: only a cyclic pass frees them, and
    the idle moment runs one before the trim (``tune_gc`` makes the engine's own passes rare)."""
    import gc
    import weakref

    from prefixserve.sampling.params import SamplingParams
    from prefixserve.sequence import Request, Sequence, token_array

    req = Request("r", None, token_array([1, 2]), token_array([0, 1]), SamplingParams())
    req.sequences.append(Sequence(0, req, 0, token_array([1, 2]), token_array([0, 1])))

    class Held:  # something the request holds (its slots take no weak reference themselves)
        pass

    req.rules["held"] = Held()
    gone = weakref.ref(req.rules["held"])
    order: list[str] = []
    trim = IdleTrim(trim=lambda: order.append("trim" if gone() is None else "trim before the collect"))
    del req
    gc.disable()
    try:
        assert gone() is not None  # a cycle: no reference count reaches zero
        trim.busy()
        assert trim.idle()
    finally:
        gc.enable()
    assert gone() is None and order == ["trim"]
