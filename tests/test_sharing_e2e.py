"""Shared-segment attention end to end on the default model: same greedy outputs, fewer KV reads."""

from __future__ import annotations

import pytest

from prefixserve import LLM, SamplingParams
from prefixserve.sequence import Sequence
from tests.conftest import assert_pool_empty

SYSTEM = " ".join(
    f"Policy {i}: keep answers short, cite the rule number, and stay kind to user {i}." for i in range(20)
)
FEW_SHOT = " ".join(f"Example {i}: {i} plus {i} is {2 * i}." for i in range(20))


@pytest.fixture(scope="module")
def engines(default_llm: LLM) -> dict[str, LLM]:
    """The session's reference engine (the oracle) and one with the cascade backend, alike otherwise."""
    cascade = LLM(dtype="float32", device="cpu", attention="cascade", num_kv_blocks=1024, progress=False)
    return {"reference": default_llm, "cascade": cascade}


def _run(llm: LLM, prompts: list, params: SamplingParams) -> tuple[list[list[list[int]]], dict[str, float]]:
    before = llm.metrics()
    outs = llm.generate(prompts, params)
    after = llm.metrics()
    delta = {k: after[k] - before.get(k, 0) for k in after if k.endswith("_total")}
    assert_pool_empty(llm)
    return [[c.token_ids for c in o.outputs] for o in outs], delta


def test_sixteen_requests_sharing_a_long_system_prompt(engines: dict[str, LLM]) -> None:
    tok = engines["reference"].get_tokenizer()
    render = engines["reference"].render_chat
    prompts = [
        {
            "prompt_token_ids": tok.encode(
                render(
                    [
                        {"role": "system", "content": SYSTEM},
                        {"role": "user", "content": f"What does policy {i} say?"},
                    ]
                ),
                add_special_tokens=False,
            )
        }
        for i in range(16)
    ]
    assert len(prompts[0]["prompt_token_ids"]) > 450  # 28 blocks shared
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)  # a prefill, two decode steps
    ref, _ = _run(engines["reference"], prompts, params)
    got, m = _run(engines["cascade"], prompts, params)
    assert got == ref
    assert m["cascade_steps_total"] > 0
    # Decode steps read the shared system prompt once per layer instead of 16 times.
    assert m["attention_kv_tokens_logical_total"] / m["attention_kv_tokens_read_total"] > 4


def test_n_samples_decode_over_one_shared_prompt(engines: dict[str, LLM]) -> None:
    prompt = "Write a one-line slogan for a bakery. " + FEW_SHOT
    # a prefill and three decode steps over the shared prompt (8 tokens: 4 more such steps, 1.5x the time)
    params = SamplingParams(n=8, temperature=0.8, seed=11, max_tokens=4, ignore_eos=True)
    ref, _ = _run(engines["reference"], [prompt], params)
    got, m = _run(engines["cascade"], [prompt], params)
    assert got == ref and len(got[0]) == 8
    assert m["shared_segments_total"] > 0
    assert m["attention_kv_tokens_logical_total"] > 3 * m["attention_kv_tokens_read_total"]


def test_two_level_tree_few_shot_then_problems_then_samples(engines: dict[str, LLM]) -> None:
    problems = [
        f" Problem {p}: what is {p + 3} plus {p + 4}? Think step by step about problem {p} carefully." * 3
        for p in range(4)
    ]
    prompts = [FEW_SHOT + problem for problem in problems]
    params = SamplingParams(n=4, temperature=0.0, max_tokens=3, ignore_eos=True)  # a prefill, two decodes
    ref, _ = _run(engines["reference"], prompts, params)
    got, m = _run(engines["cascade"], prompts, params)
    assert got == ref
    plan_llm = engines["cascade"]
    assert plan_llm.metrics()["shared_segments_total"] > 0
    assert m["attention_kv_tokens_logical_total"] > 3 * m["attention_kv_tokens_read_total"]


def test_pinned_system_prompts_survive_memory_pressure(tiny_config_path) -> None:
    apps = {
        "travel": "You plan trips and answer briefly. " * 12,
        "chef": "You cook Italian food and explain recipes. " * 10,
    }
    llm = LLM(
        model=f"dummy:{tiny_config_path}",
        dtype="float32",
        num_kv_blocks=40,
        max_num_batched_tokens=64,
        progress=False,
        system_prompts=apps,
    )
    engine = llm.engine
    pinned = {name: list(p.blocks) for name, p in engine.system_prompt_kv.items()}
    assert all(len(b) >= 4 for b in pinned.values())
    assert llm.metrics()["kv_blocks_pinned"] == sum(len(b) for b in pinned.values())
    # Flood the tiny pool: evictions and preemptions happen, the pinned blocks stay indexed and held.
    flood = [{"prompt_token_ids": [500 + i * 13 + j for j in range(60)]} for i in range(8)]
    llm.generate(flood, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    assert engine.pool.evictions > 0
    for blocks in pinned.values():
        assert [engine.pool.ref_counts[b] for b in blocks] == [1] * len(blocks)
        assert engine.pool.lookup([engine.pool.digest_of(b) for b in blocks]) == blocks
    # Each application gets its own prompt, served from its pinned blocks.
    for name in apps:
        out = llm.chat(
            [{"role": "user", "content": "Hello?"}], SamplingParams(max_tokens=2), application=name
        )[0]
        expected = engine.system_prompt_kv[name].token_ids
        assert out.prompt_token_ids[: len(expected)] == expected
        assert out.num_cached_tokens == len(pinned[name]) * engine.config.block_size
    # A conversation with its own system message keeps it, alone, also in a batch beside one without.
    own = [{"role": "system", "content": "Talk like a pirate."}, {"role": "user", "content": "Hello?"}]
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    mixed = llm.chat([own, [{"role": "user", "content": "Hello?"}]], greedy, application="chef")
    plain = llm.chat(own, greedy)[0]
    assert mixed[0].prompt_token_ids == plain.prompt_token_ids
    assert mixed[0].outputs[0].token_ids == plain.outputs[0].token_ids
    chef = engine.system_prompt_kv["chef"].token_ids
    assert mixed[1].prompt_token_ids[: len(chef)] == chef
    raw = llm.generate("Plain question", SamplingParams(max_tokens=2), application="chef")[0]
    assert raw.prompt_token_ids[: len(chef)] == chef
    with pytest.raises(ValueError, match="unknown application 'nope'"):
        llm.generate("x", application="nope")
    assert engine.pool.num_used == sum(len(b) for b in pinned.values())
    engine.pool.check_integrity()


def test_pinning_leaves_the_traffic_metrics_at_zero(tiny_config_path) -> None:
    llm = LLM(
        model=f"dummy:{tiny_config_path}",
        dtype="float32",
        num_kv_blocks=40,
        progress=False,
        system_prompts={"a": "Answer briefly. " * 10},
    )
    m = llm.metrics()
    assert m["requests_total"] == m["prompt_tokens_total"] == m["steps_total"] == 0
    assert m["kv_blocks_pinned"] > 0
    llm.generate("hi", SamplingParams(max_tokens=1))
    with pytest.raises(RuntimeError, match="start-up"):
        llm.engine.add_request("busy", prompt_token_ids=[5, 6, 7])
        llm.engine.pin_system_prompt("b", "Other prompt.")


def test_application_requests_reuse_the_pinned_digests(tiny_config_path) -> None:
    """A request after a pinned prompt starts with the pin's digests instead of hashing them again;
    they are the digests its tokens hash to (so prefix-cache hits are unchanged)."""
    llm = LLM(
        model=f"dummy:{tiny_config_path}",
        dtype="float32",
        num_kv_blocks=80,
        progress=False,
        system_prompts={"a": "Answer briefly. " * 10},
    )
    engine = llm.engine
    pinned = engine.system_prompt_kv["a"]
    req = engine.add_request(
        "r", params=SamplingParams(max_tokens=1), prompt_token_ids=[5, 6, 7], application="a"
    )
    seq = req.sequences[0]
    assert seq.block_digests == pinned.digests and seq.block_digests is not pinned.digests
    fresh = Sequence(99, req, 0, list(seq.token_ids), list(seq.positions))
    assert engine.blocks.digests(fresh, len(pinned.digests)) == pinned.digests
    out = engine.step()
    while engine.has_unfinished():
        out += engine.step()
    assert out[-1].num_cached_tokens == len(pinned.blocks) * engine.config.block_size
    salted = engine.add_request(
        "s", params=SamplingParams(max_tokens=1), prompt_token_ids=[5], application="a", cache_salt="x"
    )
    assert salted.sequences[0].block_digests == []  # a salted request hashes its own
