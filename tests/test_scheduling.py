"""Scheduler behaviour end to end: preemption, abort, n > 1 block sharing, no leaks."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefixserve import LLM, SamplingParams
from tests.conftest import assert_pool_empty


def _tiny(config: Path, **kwargs) -> LLM:
    return LLM(model=f"dummy:{config}", dtype="float32", attention="reference", progress=False, **kwargs)


def _prompts(n: int) -> list[dict]:
    return [{"prompt_token_ids": [100 + (i * 7 + j * 3) % 500 for j in range(20 + 9 * i)]} for i in range(n)]


def test_preemption_under_a_tiny_pool_gives_the_same_outputs(tiny_config_path: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    big = _tiny(tiny_config_path, num_kv_blocks=512)
    expected = [o.outputs[0].token_ids for o in big.generate(_prompts(8), params)]
    small = _tiny(tiny_config_path, num_kv_blocks=14, block_size=16, max_num_batched_tokens=64)
    got = [o.outputs[0].token_ids for o in small.generate(_prompts(8), params)]
    assert small.metrics()["preemptions_total"] > 0
    assert got == expected
    assert_pool_empty(big)
    assert_pool_empty(small)


def test_abort_mid_generation_frees_blocks(tiny_config_path: Path) -> None:
    llm = _tiny(tiny_config_path, num_kv_blocks=64)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    engine.add_request("a", prompt_token_ids=list(range(100, 140)), params=params)
    engine.add_request("b", prompt_token_ids=list(range(200, 230)), params=params)
    for _ in range(5):
        engine.step()
    assert engine.pool.num_used > 0
    assert engine.abort("a")
    outs = engine.step()
    aborted = [o for o in outs if o.request_id == "a"]
    assert aborted and aborted[0].outputs[0].finish_reason == "abort"
    while engine.has_unfinished():
        engine.step()
    assert_pool_empty(llm)
    assert not engine.abort("missing")


def test_n_samples_share_the_prompt_blocks(tiny_config_path: Path) -> None:
    llm = _tiny(tiny_config_path, num_kv_blocks=128)
    engine = llm.engine
    prompt = list(range(300, 300 + 64))  # exactly 4 full blocks
    engine.add_request(
        "r", prompt_token_ids=prompt, params=SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=6)
    )
    engine.step()  # prefill + fork
    # 4 prompt blocks held once (ref count 4) + one fresh block per sample for its first token.
    shared = [b for b in range(engine.pool.num_blocks) if engine.pool.ref_counts[b] == 4]
    assert len(shared) == 4
    engine.step()
    assert engine.pool.num_used == 4 + 4
    while engine.has_unfinished():
        engine.step()
    assert_pool_empty(llm)


def test_n_samples_differ_and_are_reproducible(tiny_config_path: Path) -> None:
    llm = _tiny(tiny_config_path, num_kv_blocks=128)
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(50, 90))}
    first = [c.token_ids for c in llm.generate(prompt, params)[0].outputs]
    again = [c.token_ids for c in llm.generate(prompt, params)[0].outputs]
    assert first == again
    assert len({tuple(t) for t in first}) > 1
    assert_pool_empty(llm)


@pytest.mark.parametrize("max_batched", [7, 2048])
def test_chunked_prefill_matches_whole_prefill(tiny_config_path: Path, max_batched: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    ref = _tiny(tiny_config_path, num_kv_blocks=128)
    expected = [o.outputs[0].token_ids for o in ref.generate(_prompts(3), params)]
    llm = _tiny(tiny_config_path, num_kv_blocks=128, max_num_batched_tokens=max_batched)
    assert [o.outputs[0].token_ids for o in llm.generate(_prompts(3), params)] == expected


def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving(tiny_config_path: Path) -> None:
    llm = _tiny(tiny_config_path, num_kv_blocks=64)
    engine = llm.engine
    real_forward = engine.backend.forward
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected kernel failure")
        return real_forward(*args, **kwargs)

    engine.backend.forward = flaky  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("doomed", prompt_token_ids=list(range(100, 130)), params=params)
    outs = engine.step()
    assert [o.outputs[0].finish_reason for o in outs if o.request_id == "doomed"] == ["error"]
    assert engine.pool.num_used == 0
    out = llm.generate({"prompt_token_ids": list(range(100, 130))}, params)[0]
    assert len(out.outputs[0].token_ids) == 4
    assert_pool_empty(llm)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_and_sharing_keeps_greedy_outputs(tiny_config_path: Path, dtype: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    shared = list(range(400, 464))
    prompts = [{"prompt_token_ids": [*shared, 900 + i, 901 + i]} for i in range(4)]
    outs = {}
    for attention in ("reference", "cascade"):
        llm = LLM(
            model=f"dummy:{tiny_config_path}",
            dtype=dtype,
            attention=attention,
            num_kv_blocks=64,
            progress=False,
        )
        assert llm.engine.kv.tensor.dtype == getattr(__import__("torch"), dtype)
        outs[attention] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert_pool_empty(llm)
    assert outs["cascade"] == outs["reference"]
    assert all(len(t) == 8 for t in outs["reference"])


def test_an_n_request_aborted_before_its_prompt_ends_reports_n_samples(tiny_config_path: Path) -> None:
    """The samples split off only once the prompt is done; an abort before that still reports all n,
    each empty and aborted (as vLLM reports every child of an aborted parent)."""
    llm = _tiny(tiny_config_path, num_kv_blocks=64, max_num_batched_tokens=32)
    engine = llm.engine
    params = SamplingParams(n=3, best_of=4, temperature=0.7, max_tokens=8)
    engine.add_request("a", prompt_token_ids=list(range(100, 200)), params=params)
    engine.step()  # the first 32-token chunk of the 100-token prompt
    assert engine.abort("a")
    (out,) = [o for o in engine.step() if o.request_id == "a"]
    assert out.finished
    assert sorted(c.index for c in out.outputs) == [0, 1, 2]
    assert all(c.finish_reason == "abort" and c.token_ids == [] and c.text == "" for c in out.outputs)
    assert_pool_empty(llm)


def test_a_preempted_sequence_finding_its_own_blocks_is_no_prefix_cache_hit(tiny_config_path: Path) -> None:
    """``prefix_cache_hit_tokens_total`` counts prompt tokens found in the cache at a sequence's first
    admission (vLLM's ``prefix_cache_hits``): prompts that share nothing hit nothing, however often
    their sequences are preempted and take their own blocks back. A repeat then hits its full blocks."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    small = _tiny(tiny_config_path, num_kv_blocks=14, block_size=16, max_num_batched_tokens=64)
    prompts = _prompts(8)  # no two share a first token
    outs = small.generate(prompts, params)
    m = small.metrics()
    assert m["preemptions_total"] > 0
    assert m["prefix_cache_hit_tokens_total"] == 0
    assert [o.num_cached_tokens for o in outs] == [0] * len(prompts)  # set at the first admission too
    one = SamplingParams(temperature=0.0, max_tokens=1)
    small.generate(prompts[7], one)
    before = small.metrics()["prefix_cache_hit_tokens_total"]
    again = small.generate(prompts[7], one)[0]  # 83 tokens: 5 full blocks, cached by the one before
    assert small.metrics()["prefix_cache_hit_tokens_total"] - before == again.num_cached_tokens == 80
    assert_pool_empty(small)
