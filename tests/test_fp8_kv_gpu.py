"""FP8 KV cache on a GPU: the compiled Triton paths (the RoPE kernel's e4m3 store, the paged, packed
decode and shared-segment kernels, decode CUDA graphs, piecewise graphs) over an e4m3 cache give the
FP8 reference path's greedy tokens, with prompts sharing a prefix. Skipped without CUDA.
(tests/kernels/test_fp8_kv_kernels.py runs compiled on a GPU too: bounds against fp64, the store bit
for bit.)"""

from __future__ import annotations

import pytest
import torch

from prefixserve import LLM, SamplingParams
from prefixserve.attention.backend import make_backend
from prefixserve.attention.kv_quant import FP8, dequantize, pow2_scales, quantize, rotate
from prefixserve.attention.metadata import build_metadata
from prefixserve.attention.window import attend_layer
from tests.conftest import assert_pool_empty

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _llm(config_path, attention: str, eager: bool, dtype: str = "float32") -> LLM:
    return LLM(
        f"dummy:{config_path}",
        dtype=dtype,
        device="cuda",
        attention=attention,
        enforce_eager=eager,
        kv_cache_dtype="fp8",
        num_kv_blocks=256,
        block_size=16,
        max_num_batched_tokens=128,
        progress=False,
    )


def test_fp8_greedy_equal_with_graphs_and_sharing(tiny_config_path) -> None:
    prefix = [(7 * i + 3) % 4000 + 100 for i in range(70)]
    prompts = [{"prompt_token_ids": [*prefix, 200 + i, 300 + 2 * i, 17 + i]} for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = _llm(tiny_config_path, "reference", eager=True)
    assert plain.engine.runner.kv.tensor.dtype == FP8
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    for attention in ("triton", "auto"):
        fast = _llm(tiny_config_path, attention, eager=False)
        for _ in range(2):  # the second round: the prefix from the cache, shared
            assert [o.outputs[0].token_ids for o in fast.generate(prompts, params)] == want, attention
        assert fast.engine.graphs is not None and fast.engine.graphs.captures >= 1
        m = fast.metrics()
        if attention == "triton":  # auto may keep this small prefix on the paged path (its cost rule)
            assert m["attention_kv_tokens_read_total"] < m["attention_kv_tokens_logical_total"]
        assert_pool_empty(fast)
    # the same scales every start (digests name them): a second engine's equal the first's
    assert torch.equal(plain.engine.runner.kv.scales, fast.engine.runner.kv.scales)


@pytest.mark.parametrize("query_lens", [[1, 1, 1, 1], [5, 1, 9, 2]])
def test_fp8_bf16_kernels_match_the_dequantized_reference(query_lens: list[int]) -> None:
    """bf16 q over an e4m3 cache: the Triton backends against fp32 attention over the dequantized cache
    (the kernels see exactly those values; bf16 q and P give ~2^-8 relative)."""
    gen = torch.Generator().manual_seed(sum(query_lens))
    bs, hkv, group, dim = 16, 2, 4, 128
    tables = [[4, 9, 2, 11, 12], [4, 9, 2, 13], [4, 9, 16], [20, 21]]
    seq_lens = [4 * bs + 3, 4 * bs - 1, 2 * bs + 5, bs + 7]
    k = torch.randn(40, bs, hkv, dim, generator=gen) * 3
    v = torch.randn(40, bs, hkv, dim, generator=gen)
    scales = torch.stack([pow2_scales(t.abs().amax((0, 1, 3))) for t in (k, v)]).cuda()
    k8, v8 = quantize(k.cuda(), 1 / scales[0]), quantize(v.cuda(), 1 / scales[1])
    q = torch.randn(sum(query_lens), hkv * group, dim, generator=gen).cuda().bfloat16()
    meta = build_metadata(bs, query_lens, seq_lens, tables, "cuda")
    ref_be = make_backend("reference")
    kd, vd = dequantize(k8, scales[0]), dequantize(v8, scales[1])
    want = ref_be.forward(rotate(q.float()), kd, vd, meta, dim**-0.5)  # K is read as stored: rotated
    for name in ("triton", "triton_paged", "auto"):
        be = make_backend(name)
        be.prepare(meta)
        got = attend_layer(be, q, k8, v8, meta, dim**-0.5, kv_scales=scales).float()
        err = float((got - want).norm() / want.norm())
        assert err < 1e-2, (name, err)


# d 128 and GQA 4 (the FP8 tensor-core shared kernel's shapes), small elsewhere
PRODUCTS_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 4096,
    "hidden_size": 512,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "eos_token_id": 2,
}


def _products_run(config_path, prompts, on: bool) -> tuple[list, dict]:
    """Greedy outputs (tokens, their top-5 logprobs) of an e4m3-cache engine under decode graphs with
    the shared part's products on FP8 tensor cores switched ``on`` or off, and its metrics. The
    second round is measured: the prefix comes from the cache and is shared."""
    from prefixserve.attention.kernels import shared_gluon_fp8

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5)
    with shared_gluon_fp8.products(on):
        llm = LLM(
            f"dummy:{config_path}",
            dtype="bfloat16",
            device="cuda",
            attention="triton",  # auto keeps a prefix this short on the paged path (its cost rule)
            kv_cache_dtype="fp8",
            num_kv_blocks=1024,
            max_num_seqs=128,
            max_num_batched_tokens=4096,
            progress=False,
        )
        llm.generate(prompts, params)
        outs = [o.outputs[0] for o in llm.generate(prompts, params)]
        assert llm.engine.graphs is not None and llm.engine.graphs.captures >= 1
        metrics = llm.metrics()
        assert_pool_empty(llm)
        llm.shutdown()
    return [(o.token_ids, o.top_logprobs) for o in outs], metrics


def test_fp8_products_in_the_engine_under_graphs(tmp_path, monkeypatch) -> None:
    """96 requests behind a 1,536-token prefix over an e4m3 cache, decode graphs, the shared and own
    parts as two kernels (a prefix this short would run as one mixed launch, which widens e4m3): with
    the shared part's products on FP8 tensor cores the kernel is launched, and each decode step's top
    logprobs stay within e4m3's rounding of the widened (exact-product) engine's where the tokens
    before agree."""
    import json

    from prefixserve.attention.kernels import shared_gluon, shared_gluon_fp8
    from tests.kernels._kernel_helpers import CountedCalls

    monkeypatch.setenv("PREFIXSERVE_MIXED", "0")
    if not shared_gluon.eligible_for("cuda", torch.bfloat16, 128):
        pytest.skip("needs a Hopper GPU and Gluon")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(PRODUCTS_CONFIG))
    prefix = [(7 * i + 3) % 4000 + 50 for i in range(1536)]
    prompts = [{"prompt_token_ids": [*prefix, 60 + i, 900 + 3 * i]} for i in range(96)]
    counter = CountedCalls(monkeypatch, shared_gluon_fp8, "launch")
    exact, _ = _products_run(path, prompts, on=False)
    assert not counter.calls
    fp8, metrics = _products_run(path, prompts, on=True)
    assert counter.calls
    assert metrics["attention_kv_tokens_read_total"] < metrics["attention_kv_tokens_logical_total"]
    worst, compared, same = 0.0, 0, 0
    for (want_ids, want_top), (got_ids, got_top) in zip(exact, fp8, strict=True):
        same += want_ids == got_ids
        for step in range(len(want_ids)):
            if want_ids[:step] != got_ids[:step]:
                break
            theirs, ours = dict(want_top[step]), dict(got_top[step])
            for token in theirs.keys() & ours.keys():
                worst = max(worst, abs(theirs[token] - ours[token]))
                compared += 1
    print(f"fp8 products: {same}/{len(exact)} greedy rows equal, worst top-5 logprob gap {worst:.4f}")
    assert compared >= 5 * len(exact)
    assert worst < 0.1
    assert same >= len(exact) // 2
