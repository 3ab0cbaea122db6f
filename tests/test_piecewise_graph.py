"""Eager steps through the piecewise path (dense pieces between attentions, padded to a bucket) give
what the plain forward gives: exactly on a CPU in fp32 (the same ops, without graphs), and to bf16
tolerance with captured graphs on a GPU. Padding rows write only the cache's scratch slot."""

from __future__ import annotations

import json
import random

import pytest
import torch

from prefixserve import LLM, SamplingParams
from prefixserve.worker.piecewise_graph import PiecewiseGraphs, token_buckets
from tests.conftest import TINY_CONFIG, assert_pool_empty


def test_token_buckets() -> None:
    assert token_buckets(1024) == [16, 24, 32, 48, 64, 96, 128, 192, *range(256, 1025, 64)]
    assert token_buckets(100) == [16, 24, 32, 48, 64, 96, 100]
    assert token_buckets(300) == [16, 24, 32, 48, 64, 96, 128, 192, 256, 300]
    assert token_buckets(16) == [16]


def _llm(path: str, device: str = "cpu", **kw) -> LLM:
    return LLM(model=f"dummy:{path}", dtype="float32", device=device, num_kv_blocks=512, progress=False, **kw)


def _workload(seed: int) -> tuple[list[dict], list[SamplingParams]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 200) for _ in range(40)]
    # prompts of 5-90 tokens: under and over the 64-token cap; a shared prefix; n=2
    prompts = [
        {"prompt_token_ids": shared[: rng.randrange(40)] + [rng.randrange(3, 200) for _ in range(5 + 7 * i)]}
        for i in range(8)
    ]
    params = [
        SamplingParams(n=1 + i % 2, temperature=0.0, max_tokens=6 + i, ignore_eos=True) for i in range(8)
    ]
    return prompts, params


def _tokens(llm: LLM, prompts: list[dict], params: list[SamplingParams]) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]


def test_pieces_equal_the_plain_forward_on_cpu(tmp_path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_CONFIG))
    prompts, params = _workload(0)
    plain = _llm(str(path), max_num_batched_tokens=64)
    want = _tokens(plain, prompts, params)

    piecewise = _llm(str(path), max_num_batched_tokens=64)
    runner = piecewise.engine.runner
    runner.pieces = PiecewiseGraphs(runner.model, runner.kv, 64, capture=False)
    calls = []
    run = runner.pieces.run
    runner.pieces.run = lambda ids, *a: calls.append(len(ids)) or run(ids, *a)
    got = _tokens(piecewise, prompts, params)
    assert got == want  # padding rows wrote only the scratch slot, or some sequence's KV would differ
    assert calls and max(calls) <= 64 and any(c not in token_buckets(64) for c in calls)  # padded steps ran
    assert_pool_empty(piecewise)


def test_capture_graphs_runs_every_bucket_and_gives_back_its_blocks(tmp_path) -> None:
    """The start-up pass (``Engine.capture_graphs``) steps once per bucket over borrowed blocks."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_CONFIG))
    prompts, params = _workload(2)
    want = _tokens(_llm(str(path), max_num_batched_tokens=64), prompts, params)
    llm = _llm(str(path), max_num_batched_tokens=64)
    runner = llm.engine.runner
    runner.pieces = PiecewiseGraphs(runner.model, runner.kv, 64, capture=False)
    seen = []
    run = runner.pieces.run
    runner.pieces.run = lambda ids, *a: seen.append(len(ids)) or run(ids, *a)
    free = llm.engine.pool.num_free
    assert llm.engine.capture_graphs() == 0  # nothing to capture on a CPU; every bucket stepped
    assert seen == token_buckets(64) and llm.engine.pool.num_free == free
    assert _tokens(llm, prompts, params) == want
    assert_pool_empty(llm)


def test_piece_hidden_states_match_forward_exactly(tmp_path) -> None:
    """One prefill step, the hidden states of both paths compared bit for bit (fp32, CPU)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_CONFIG))
    llm = _llm(str(path))
    runner = llm.engine.runner
    pieces = PiecewiseGraphs(runner.model, runner.kv, 64, capture=False)
    ids = list(range(5, 42))
    positions = list(range(len(ids)))
    tables = torch.arange(3, dtype=torch.int32)[None].numpy()
    batch = runner.prepare_batch(positions, [len(ids)], [len(ids)], tables)
    want = runner._forward(ids, batch)[0].clone()
    got = pieces.run(ids, positions, batch.meta, runner.backend)
    assert torch.equal(got, want)


@pytest.mark.gpu
def test_captured_pieces_match_eager_on_gpu(tmp_path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = dict(TINY_CONFIG, hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=32)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    prompts, params = _workload(1)
    want = _tokens(_llm(str(path), "cuda", enforce_eager=True, max_num_batched_tokens=64), prompts, params)
    for attention in ("triton_paged", "auto"):
        llm = _llm(str(path), "cuda", attention=attention, max_num_batched_tokens=64)
        assert _tokens(llm, prompts, params) == want, attention
        assert llm.engine.runner.pieces.captures >= 2, attention
        assert_pool_empty(llm)


def test_pieces_take_layers_of_other_head_sizes(tmp_path) -> None:
    """Gemma 4's global layers have wider heads than its sliding ones: the pieces' q and output
    buffers are viewed per layer, and the tokens equal the plain forward's."""
    pytest.importorskip("transformers.models.gemma4", reason="this transformers has no Gemma 4")
    from tests.test_model_families import _llm as family_llm
    from tests.test_model_families import _prompt, tiny_checkpoint

    tiny_checkpoint("gemma4_text", tmp_path)
    prompts = [{"prompt_token_ids": _prompt(i, 20 + 9 * i)} for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = _tokens(family_llm(tmp_path, max_num_batched_tokens=64), prompts, [params] * 4)
    llm = family_llm(tmp_path, max_num_batched_tokens=64)
    runner = llm.engine.runner
    assert len(set(PiecewiseGraphs(runner.model, runner.kv, 64, capture=False).head_dims)) == 2
    runner.pieces = PiecewiseGraphs(runner.model, runner.kv, 64, capture=False)
    assert _tokens(llm, prompts, [params] * 4) == want
    assert_pool_empty(llm)
