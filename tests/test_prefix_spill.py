"""The prefix cache's host tier: evicted blocks come back from host memory instead of being recomputed."""

from __future__ import annotations

from prefixserve import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def run(tiny_config_path, spill: bool, **engine: object):
    """Three rounds over four documents that the pool cannot hold together; ``engine``: more
    EngineConfig fields (the FP8 KV cache's test)."""
    llm = LLM(
        f"dummy:{tiny_config_path}",
        dtype="float32",
        device="cpu",
        progress=False,
        num_kv_blocks=24,
        block_size=4,
        spill_prefix_cache=spill,
        **engine,
    )
    docs = [[1000 + 37 * d + i for i in range(40)] for d in range(4)]  # 10 blocks each: 4 do not fit
    outs = []
    for round_ in range(3):
        for d, doc in enumerate(docs):
            prompt = {"prompt_token_ids": [*doc, 7, 8, 9 + round_ + d]}
            outs.append(llm.generate(prompt, GREEDY)[0].outputs[0].token_ids)
    return llm, outs


def test_spilled_blocks_come_back_with_the_same_outputs(tiny_config_path) -> None:
    plain, want = run(tiny_config_path, spill=False)
    spilled, got = run(tiny_config_path, spill=True)
    assert got == want
    m, base = spilled.metrics(), plain.metrics()
    assert m["prefix_cache_spilled_blocks_total"] > 0
    assert m["prefix_cache_host_hit_tokens_total"] > 0
    # every host hit is a token not computed again
    assert m["prompt_tokens_computed_total"] < base["prompt_tokens_computed_total"]
    assert m["prefix_cache_hit_tokens_total"] > base["prefix_cache_hit_tokens_total"]
    spilled.engine.pool.check_integrity()
    assert spilled.engine.pool.num_used == 0
