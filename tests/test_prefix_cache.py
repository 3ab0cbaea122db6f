"""Prefix reuse is real: a repeated 400-token system prompt is computed once, outputs unchanged."""

from __future__ import annotations

from prefixserve import LLM, SamplingParams
from tests.conftest import assert_pool_empty

SYSTEM = " ".join(f"Rule {i}: answer politely and check every fact about item {i} twice." for i in range(24))
LONG = 400  # SYSTEM is 412 tokens: a request after the first reads more than 400 of them cached


def _conv(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def test_second_request_computes_only_its_own_tokens(default_llm: LLM) -> None:
    llm = default_llm
    params = SamplingParams(temperature=0.0, max_tokens=8)
    prompt_len = len(llm.get_tokenizer().encode(llm.render_chat(_conv("Hi")), add_special_tokens=False))
    assert prompt_len > LONG

    # Without the cache: the same prompt under a cache salt of its own (nothing cached matches it) is
    # computed whole, and gives the reference output.
    prompt = llm.render_chat(_conv("What is rule 7 about?"))
    cold = llm.generate({"prompt": prompt, "cache_salt": "test_prefix_cache-cold"}, params)[0]
    assert cold.num_cached_tokens == 0
    expected = cold.outputs[0].token_ids

    llm.chat(_conv("What is rule 3 about?"), params)
    before = llm.metrics()
    out = llm.chat(_conv("What is rule 7 about?"), params)[0]
    after = llm.metrics()

    hit = after["prefix_cache_hit_tokens_total"] - before["prefix_cache_hit_tokens_total"]
    computed = after["prompt_tokens_computed_total"] - before["prompt_tokens_computed_total"]
    own = len(out.prompt_token_ids) - out.num_cached_tokens
    assert hit >= LONG and out.num_cached_tokens == hit
    assert computed == own < 16 + 16  # only the question (and at most one partial block) is computed
    assert out.outputs[0].token_ids == expected
    assert_pool_empty(llm)


def test_different_cache_salts_do_not_share(default_llm: LLM) -> None:
    llm = default_llm
    params = SamplingParams(temperature=0.0, max_tokens=2)
    prompt = "A long shared preamble about tenants and their secrets. " * 20
    llm.generate({"prompt": prompt + "Q1", "cache_salt": "tenant-a"}, params)
    other = llm.generate({"prompt": prompt + "Q2", "cache_salt": "tenant-b"}, params)[0]
    same = llm.generate({"prompt": prompt + "Q3", "cache_salt": "tenant-a"}, params)[0]
    assert other.num_cached_tokens == 0
    assert same.num_cached_tokens >= 16 * 10
    assert_pool_empty(llm)


def test_requests_arriving_together_compute_a_shared_prompt_once(default_llm: LLM) -> None:
    llm = default_llm
    params = SamplingParams(temperature=0.0, max_tokens=4)
    convs = [_conv(f"Question number {i}: what is rule {i} about?") for i in range(4)]
    salt = "together"  # a fresh namespace: nothing of this prompt is cached yet
    tok = llm.get_tokenizer()
    prompts = [
        {"prompt_token_ids": tok.encode(llm.render_chat(c), add_special_tokens=False), "cache_salt": salt}
        for c in convs
    ]
    before = llm.metrics()
    outs = llm.generate(prompts, params)
    after = llm.metrics()
    computed = after["prompt_tokens_computed_total"] - before["prompt_tokens_computed_total"]
    total = sum(len(p["prompt_token_ids"]) for p in prompts)
    # The shared system prompt is computed by the first request only; the others take it from the cache.
    assert computed < total - 3 * LONG
    assert all(o.num_cached_tokens >= LONG for o in outs[1:])
    assert_pool_empty(llm)
