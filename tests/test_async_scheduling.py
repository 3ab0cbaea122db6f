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
from tests.conftest import assert_pool_empty


def _llm(tiny_config_path, async_scheduling: bool, blocks: int = 512) -> LLM:
    return LLM(
        model=f"dummy:{tiny_config_path}",
        device="cpu",
        attention="cascade",
        num_kv_blocks=blocks,
        max_num_batched_tokens=96,
        async_scheduling=async_scheduling,
        progress=False,
    )


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
    return [
        [(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs) for c in o.outputs] for o in outs
    ]


@pytest.mark.parametrize("blocks", [512, 12])  # 12 blocks: sequences are preempted and recomputed
def test_async_outputs_equal_sync(tiny_config_path, blocks: int) -> None:
    prompts, params = _workload()
    results = []
    for mode in (False, True):
        llm = _llm(tiny_config_path, mode, blocks)
        assert llm.engine.async_scheduling is mode
        results.append(_summary(llm.generate(prompts, params)))
        assert_pool_empty(llm)
        assert not llm.engine._placeholders and llm.engine._in_flight is None
    assert results[0] == results[1]


def test_abort_while_in_flight_drops_the_placeholder(tiny_config_path) -> None:
    llm = _llm(tiny_config_path, True)
    engine = llm.engine
    for i in range(3):
        engine.add_request(f"r{i}", prompt_token_ids=[5 + i] * 20, params=SamplingParams(max_tokens=30))
    for _ in range(4):
        engine.step()
    assert engine._in_flight is not None and engine._placeholders  # a step is in flight now
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
