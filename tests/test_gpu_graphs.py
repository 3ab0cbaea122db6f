"""CUDA-graph decode on a GPU: greedy outputs equal the eager reference, with sharing on and off.

Skipped without CUDA (the graph-safe kernels themselves are tested on CPU in
tests/kernels/test_graph_attention.py). Batches shrink as requests finish at different lengths, so
several buckets are captured and padded, and n=2 samples make a two-level sharing structure.
"""

from __future__ import annotations

import json
import random

import pytest

from prefixserve import LLM, SamplingParams
from tests.conftest import TINY_CONFIG, assert_pool_empty

pytestmark = pytest.mark.gpu


def _generate(path: str, attention: str, eager: bool) -> tuple[list, LLM]:
    llm = LLM(
        model=f"dummy:{path}",
        dtype="float32",
        device="cuda",
        attention=attention,
        enforce_eager=eager,
        num_kv_blocks=2048,
        progress=False,
    )
    rng = random.Random(0)
    shared = [rng.randrange(3, 200) for _ in range(600)]  # long: the paged kernel splits KV
    prompts = [
        {"prompt_token_ids": shared + [rng.randrange(3, 200) for _ in range(5 + i)]} for i in range(12)
    ]
    params = [SamplingParams(n=2, temperature=0.0, max_tokens=8 + 3 * i, ignore_eos=True) for i in range(12)]
    outs = llm.generate(prompts, params)
    return [[c.token_ids for c in o.outputs] for o in outs], llm


def test_graph_decode_matches_eager_reference(tmp_path) -> None:
    cfg = dict(TINY_CONFIG, hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=32)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    ref, _ = _generate(str(path), "reference", eager=True)
    for attention in ("triton", "triton_paged", "auto"):
        got, llm = _generate(str(path), attention, eager=False)
        assert got == ref, attention
        assert llm.engine.graphs is not None and llm.engine.graphs.captures >= 2, attention
        if attention == "triton":
            assert llm.metrics()["cascade_steps_total"] > 0
        if attention != "triton_paged":  # steps between joins and finishes carried their plans on
            assert llm.engine.backend.decode_plans.carried > 0, attention
        assert_pool_empty(llm)


@pytest.mark.parametrize("blocks", [4096, 40])  # 40 blocks: preemptions while steps are in flight
def test_launch_ahead_equals_synchronous_steps(tmp_path, blocks: int) -> None:
    """Steps launched before the host has the tokens of the step ahead (read on the device) give the
    outputs of the one-step-at-a-time engine: greedy and seeded samples, stops, n=2, preemption."""
    cfg = dict(TINY_CONFIG, hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=32)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    rng = random.Random(1)
    shared = [rng.randrange(3, 200) for _ in range(100)]
    prompts = [
        {"prompt_token_ids": shared + [rng.randrange(3, 200) for _ in range(3 + i)]} for i in range(16)
    ]
    params = [
        SamplingParams(
            n=1 + (i % 5 == 0),
            temperature=0.0 if i % 2 else 0.9,
            seed=i,
            max_tokens=10 + 2 * i,
            stop_token_ids=[rng.randrange(3, 200) for _ in range(8)] if i % 3 == 0 else [],
            logprobs=1 if i == 4 else None,
        )
        for i in range(16)
    ]
    results = []
    for mode in (False, True):
        llm = LLM(
            model=f"dummy:{path}",
            dtype="float32",
            device="cuda",
            num_kv_blocks=blocks,
            async_scheduling=mode,
            progress=False,
        )
        assert llm.engine.launch_ahead is mode
        outs = llm.generate(prompts, params)
        results.append([[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs])
        assert llm.engine.graphs is not None and llm.engine.graphs.captures >= 1
        assert_pool_empty(llm)
    assert results[0] == results[1]
