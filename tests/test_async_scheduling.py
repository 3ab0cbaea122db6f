"""Async scheduling (plan step N+1 before step N's tokens arrive) changes nothing but timing.

On a GPU it is on under CUDA graphs; here it is forced on a CPU, where the same bookkeeping runs:
placeholders for in-flight tokens, re-planning when a sequence stops on its in-flight token, aborts
while a step is in flight, preemption, forks (n > 1), seeded sampling, logprobs, stop strings.
"""

from __future__ import annotations

import random

import pytest

from prefixserve import LLM, SamplingParams
from prefixserve.engine import PLACEHOLDER_TOKEN
from prefixserve.sequence import Request
from tests.conftest import assert_pool_empty, tiny_cascade_llm


def _llm(tiny_config_path, async_scheduling: bool, blocks: int = 512) -> LLM:
    return tiny_cascade_llm(tiny_config_path, async_scheduling, blocks)


def _workload() -> tuple[list[dict], list[SamplingParams]]:
    rng = random.Random(0)
    shared = [rng.randrange(3, 2000) for _ in range(40)]
    prompts = [
        {"prompt_token_ids": shared + [rng.randrange(3, 2000) for _ in range(3 + i)]} for i in range(10)
    ]
    params = [
        SamplingParams(
            max_tokens=6 + i,
            temperature=0.0 if i % 3 else 0.8,
            seed=i,
            n=1 + (i % 4 == 0),
            logprobs=2 if i == 5 else None,
            stop_token_ids=[7, 11, 13] if i % 2 else [],
            stop=["e", "a"] if i % 3 == 1 else None,
        )
        for i in range(10)
    ]
    return prompts, params


def _summary(outs) -> list:
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]


def _logprobs(outs) -> list[float]:
    return [x for o in outs for c in o.outputs for x in c.token_logprobs or []]


@pytest.mark.parametrize("blocks", [512, 12])  # 12 blocks: sequences are preempted and recomputed
def test_async_outputs_equal_sync(tiny_config_path, blocks: int) -> None:
    prompts, params = _workload()
    results, logprobs = [], []
    for mode in (False, True):
        llm = _llm(tiny_config_path, mode, blocks)
        assert llm.engine.async_scheduling is mode and llm.engine.launch_ahead is mode
        outs = llm.generate(prompts, params)
        results.append(_summary(outs))
        logprobs.append(_logprobs(outs))
        assert_pool_empty(llm)
        assert not llm.engine.in_flight_tokens.pending and llm.engine._launched is None
    assert results[0] == results[1]
    # launch-ahead batches rows differently (a finished sequence's last row, preemptions), and fp32
    # sums depend on the batch a row is in: logprobs agree to rounding
    assert logprobs[0] == pytest.approx(logprobs[1], abs=1e-5) and logprobs[0]


def test_abort_while_in_flight_drops_the_placeholder(tiny_config_path) -> None:
    llm = _llm(tiny_config_path, True)
    engine = llm.engine
    for i in range(3):
        engine.add_request(f"r{i}", prompt_token_ids=[5 + i] * 20, params=SamplingParams(max_tokens=30))
    for _ in range(4):
        engine.step()
    assert engine._launched is not None and engine.in_flight_tokens.pending  # a step is in flight now
    engine.abort("r1")
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    finals = {o.request_id: o for o in outs if o.finished}
    assert set(finals) == {"r0", "r1", "r2"}
    assert finals["r1"].outputs[0].finish_reason == "abort"
    assert all(PLACEHOLDER_TOKEN not in c.token_ids for o in finals.values() for c in o.outputs)
    assert len(finals["r0"].outputs[0].token_ids) == 30
    assert_pool_empty(llm)


def test_stream_reports_each_token_once(tiny_config_path) -> None:
    llm = _llm(tiny_config_path, True)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    pieces = list(llm.stream(prompt, SamplingParams(max_tokens=8, ignore_eos=True)))
    assert pieces[-1].finished and len(pieces[-1].outputs[0].token_ids) == 8
    lengths = [len(p.outputs[0].token_ids) for p in pieces]
    assert lengths == sorted(lengths) and PLACEHOLDER_TOKEN not in pieces[-1].outputs[0].token_ids


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_reused_id_after_an_in_flight_abort_is_a_new_request(
    tiny_config_path, async_scheduling: bool
) -> None:
    llm = _llm(tiny_config_path, async_scheduling)
    engine = llm.engine
    engine.add_request("a", prompt_token_ids=[5] * 10, params=SamplingParams(max_tokens=20))
    outs = engine.step() + engine.step()
    engine.abort("a")
    engine.add_request("a", prompt_token_ids=[6] * 10, params=SamplingParams(max_tokens=10))
    while engine.has_unfinished():
        outs += engine.step()
    finals = [(o.outputs[0].finish_reason, o.prompt_token_ids[0]) for o in outs if o.finished]
    assert finals == [("abort", 5), ("length", 6)]
    assert_pool_empty(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_failing_device_sync_fails_its_requests_and_the_engine_goes_on(
    tiny_config_path, async_scheduling: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefixserve.sampling import sampler

    llm = _llm(tiny_config_path, async_scheduling)
    engine = llm.engine
    engine.add_request("bad", prompt_token_ids=[5] * 10, params=SamplingParams(max_tokens=20))
    original = sampler.SampleFuture.result

    def broken(self):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(sampler.SampleFuture, "result", broken)
    outs = []
    for _ in range(2):
        outs += engine.step()
    monkeypatch.setattr(sampler.SampleFuture, "result", original)
    assert [(o.request_id, o.outputs[0].finish_reason) for o in outs if o.finished] == [("bad", "error")]
    good = llm.generate([{"prompt_token_ids": [7] * 10}], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(good[0].outputs[0].token_ids) == 4
    assert_pool_empty(llm)


def test_launch_ahead_issues_a_step_before_waiting_for_the_one_ahead(tiny_config_path) -> None:
    """The point of launch-ahead: step N+1's forward is issued before step N's tokens are waited for."""
    llm = _llm(tiny_config_path, True)
    runner, events = llm.engine.runner, []
    forward, wait = runner.forward, runner.wait

    def logged_forward(ids, batch, copies, feed=None):
        launch = forward(ids, batch, copies, feed)
        events.append(("forward", id(launch), feed is not None))
        return launch

    def logged_wait(launch):
        events.append(("wait", id(launch), False))
        return wait(launch)

    runner.forward, runner.wait = logged_forward, logged_wait
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=6, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6
    kinds = [(k, fed) for k, _, fed in events]
    # prefill, then every decode step goes out (fed its ids on the device) before the previous wait
    assert kinds[:3] == [("forward", False), ("forward", True), ("wait", False)]
    launched = [i for k, i, _ in events if k == "forward"]
    waited = [i for k, i, _ in events if k == "wait"]
    assert waited == launched  # every launch waited for once, in order
    # the last token is known to be the last by length: no step is launched after it
    assert len(launched) == 6


def test_feed_writes_device_tokens_in_order_and_permuted() -> None:
    import torch

    from prefixserve.worker.model_runner import PrevTokenFeed

    tokens = torch.tensor([40, 41, 42])
    ids = torch.tensor([-1, -1, -1, 9])
    PrevTokenFeed([0, 1, 2], [0, 1, 2], tokens).apply(ids)
    assert ids.tolist() == [40, 41, 42, 9]
    ids = torch.tensor([7, -1, 8, -1])
    PrevTokenFeed([1, 3], [2, 0], tokens).apply(ids)
    assert ids.tolist() == [7, 42, 8, 40]


def test_launch_ahead_indexes_generated_blocks_by_their_real_tokens(tiny_config_path) -> None:
    """Blocks filled by generated tokens enter the prefix cache only once their tokens are known:
    a follow-up prompt made of the first request's prompt and output hits them, and the outputs
    equal the synchronous engine's."""
    results = []
    for mode in (False, True):
        llm = _llm(tiny_config_path, mode)
        first = [{"prompt_token_ids": list(range(3, 23))}]
        params = SamplingParams(max_tokens=45, ignore_eos=True)
        out = llm.generate(first, params)[0].outputs[0].token_ids
        follow = [{"prompt_token_ids": list(range(3, 23)) + out + [5]}]
        hit = llm.engine.metrics()["prefix_cache_hit_tokens_total"]
        again = llm.generate(follow, SamplingParams(max_tokens=8, ignore_eos=True))[0]
        hit = llm.engine.metrics()["prefix_cache_hit_tokens_total"] - hit
        assert hit >= 48  # the prompt's and the generated tokens' full blocks
        assert again.num_cached_tokens == hit
        results.append((out, again.outputs[0].token_ids))
        assert_pool_empty(llm)
    assert results[0] == results[1]


def _run_with_a_failing_sampling(tiny_config_path, launch_ahead: bool, monkeypatch) -> tuple[dict, Request]:
    """Requests a and b run together; the sampling of the batch launched by the third ``step`` fails
    (in launch-ahead that sampling waits for the tokens ahead of it, as a grammar's does, so it fails
    at the fourth ``step``, after that step admitted c); c arrives right after the third ``step``.
    Returns each request's finish reason and tokens, and c."""
    llm = _llm(tiny_config_path, launch_ahead)
    engine, runner = llm.engine, llm.engine.runner
    forward, sample, launches = runner.forward, runner.sample, []

    def counted_forward(*args, **kwargs):
        launches.append(forward(*args, **kwargs))
        return launches[-1]

    def failing_sample(launch, *args, **kwargs):
        if len(launches) >= 3 and launch is launches[2]:
            raise RuntimeError("injected: sampling failed")
        return sample(launch, *args, **kwargs)

    monkeypatch.setattr(runner, "forward", counted_forward)
    monkeypatch.setattr(runner, "sample", failing_sample)
    monkeypatch.setattr(engine.rules, "waits", lambda samplers, indices, params: True)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.add_request("a", prompt_token_ids=list(range(5, 15)), params=params)
    engine.add_request("b", prompt_token_ids=list(range(50, 62)), params=params)
    outs = engine.step() + engine.step() + engine.step()
    c = engine.add_request("c", prompt_token_ids=list(range(100, 120)), params=params)
    while engine.has_unfinished():
        outs += engine.step()
    assert len(launches) >= 3
    assert_pool_empty(llm)
    assert not engine.in_flight_tokens.pending and engine._launched is None
    finals = {o.request_id: (o.outputs[0].finish_reason, o.outputs[0].token_ids) for o in outs if o.finished}
    assert engine.metrics()["preemptions_total"] == 0  # nothing was short of blocks
    return finals, c


def test_a_failed_deferred_sampling_fails_the_same_requests_as_sync(tiny_config_path, monkeypatch) -> None:
    """Launch-ahead: the sampling of the step in flight fails after the next step was planned; only the
    failed step's requests fail (as in sync mode), the next step's newcomer goes back to the queue."""
    sync, sync_c = _run_with_a_failing_sampling(tiny_config_path, False, monkeypatch)
    monkeypatch.undo()
    ahead, ahead_c = _run_with_a_failing_sampling(tiny_config_path, True, monkeypatch)
    assert {r for r, (why, _) in sync.items() if why == "error"} == {"a", "b"}
    assert {r for r, (why, _) in ahead.items() if why == "error"} == {"a", "b"}
    assert sync["c"][0] == ahead["c"][0] == "length" and len(ahead["c"][1]) == 8
    assert ahead["c"] == sync["c"]
    # launch-ahead had admitted c to the step that never went out: it was put back in the queue
    assert (sync_c.sequences[0].num_preemptions, ahead_c.sequences[0].num_preemptions) == (0, 1)


def test_generate_leaves_no_step_in_flight(tiny_config_path) -> None:
    """A request that stops on a token (not by length) has its next step launched already; generate
    (and stream) completes that step before it returns: nothing in flight, every block back in the pool."""
    llm = _llm(tiny_config_path, True)
    engine = llm.engine
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9]}
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens = llm.generate(prompt, greedy)[0].outputs[0].token_ids
    stop = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[tokens[4]])
    out = llm.generate(prompt, stop)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == tokens[: tokens.index(tokens[4]) + 1]
    assert engine._launched is None and not engine.has_unfinished()
    assert not engine.in_flight_tokens.pending
    assert_pool_empty(llm)
    assert list(llm.stream(prompt, stop))[-1].outputs[0].token_ids == out.token_ids  # the same for stream
    assert engine._launched is None and not engine.has_unfinished()
    assert_pool_empty(llm)


def test_step_host_seconds_stay_within_the_steps(tiny_config_path, monkeypatch) -> None:
    """Launch-ahead on a CPU, with samplings that wait a step and a caller busy between steps: the
    host part of the steps is never negative and never more than their wall time."""
    import time

    llm = _llm(tiny_config_path, True)
    engine = llm.engine
    monkeypatch.setattr(engine.rules, "waits", lambda samplers, indices, params: True)
    for i in range(3):
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        engine.add_request(f"r{i}", prompt_token_ids=[5 + i] * 20, params=params)
    before = engine.metrics()
    wall = time.perf_counter()
    while engine.has_unfinished():
        at = engine.metrics()["step_host_seconds_total"]
        engine.step()
        assert engine.metrics()["step_host_seconds_total"] >= at  # no step's host part is negative
        time.sleep(0.02)  # the caller's own work between steps (a server's outputs, new requests)
    wall = time.perf_counter() - wall
    after = engine.metrics()
    host = after["step_host_seconds_total"] - before["step_host_seconds_total"]
    steps = after["step_seconds_total"] - before["step_seconds_total"]
    assert 0 < host <= steps <= wall
