"""Speculative decoding by prompt lookup (``speculative_config``, ``engine/speculative.py``): greedy
outputs equal those without it, under chunked prefill, preemption, stops, limits and aborts; drafts
that hold cut the steps; the pool's books balance; the rule that keeps drafts is the rejection rule
of a proposal certain of its token."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from prefixserve import LLM, SamplingParams
from prefixserve.config import EngineConfig, SpeculativeConfig
from prefixserve.engine.speculative import lookup
from tests.conftest import TINY_CONFIG, assert_pool_empty

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
TEXT = (
    "Prefix sharing lets many requests read one copy of a long context. The engine keeps each block "
    "of keys and values once and every request that starts with the same tokens points at it."
)
CHATS = [
    [{"role": "user", "content": f"Repeat this text exactly, word for word:\n\n{TEXT}"}],
    [{"role": "user", "content": f"{TEXT}\n\nQuote the second sentence of the text above."}],
    [{"role": "user", "content": "Count from one to twenty in words, separated by commas."}],
]


def reference_lookup(tokens: list[int], longest: int, shortest: int, count: int) -> list[int]:
    size = len(tokens)
    for n in range(min(longest, size - 1), shortest - 1, -1):
        hits = [s for s in range(size - n) if tokens[s : s + n] == tokens[size - n :]]
        if hits:
            return tokens[hits[-1] + n : hits[-1] + n + count]
    return []


def test_lookup_finds_the_latest_longest_earlier_match() -> None:
    rng = np.random.default_rng(0)
    for _ in range(2000):
        tokens = rng.integers(0, int(rng.integers(1, 6)), size=int(rng.integers(1, 40))).tolist()
        shortest = int(rng.integers(1, 4))
        longest, count = int(rng.integers(shortest, 6)), int(rng.integers(1, 6))
        got = lookup(np.asarray(tokens, dtype=np.int64), longest, shortest, count)
        assert got == reference_lookup(tokens, longest, shortest, count), (tokens, longest, shortest, count)
    assert lookup(np.asarray([1, 2, 3, 9, 1, 2], dtype=np.int64), 2, 1, 3) == [3, 9, 1]


def test_the_config_is_checked_naming_the_field() -> None:
    assert SpeculativeConfig.from_dict({"num_speculative_tokens": 3}) == SpeculativeConfig(3, 4, 1)
    assert (
        SpeculativeConfig.from_dict({"num_speculative_tokens": 3, "prompt_lookup_min": 6}).prompt_lookup_max
        == 6
    )
    for bad, match in (
        ({"method": "eagle", "num_speculative_tokens": 3}, "method 'eagle' is not supported"),
        ({}, "needs num_speculative_tokens"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
        (
            {"num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 3},
            "prompt_lookup_min must be <=",
        ),
        ({"num_speculative_tokens": 2, "draft_model": "x"}, "unknown keys"),
    ):
        with pytest.raises(ValueError, match=match):
            EngineConfig(speculative_config=bad)
    with pytest.raises(ValueError, match="async_scheduling off"):
        EngineConfig(speculative_config={"num_speculative_tokens": 2}, async_scheduling=True)


@pytest.fixture(scope="module")
def pair() -> tuple[LLM, LLM]:
    """The default model in fp32 without and with speculation (cascade attention, 40-token steps)."""
    kw = dict(dtype="float32", device="cpu", attention="cascade", num_kv_blocks=1024, progress=False)
    kw["max_num_batched_tokens"] = 40
    return LLM(**kw), LLM(**kw, speculative_config=SPEC)


def test_greedy_outputs_are_unchanged_and_take_fewer_steps(pair: tuple[LLM, LLM]) -> None:
    plain, spec = pair
    greedy = SamplingParams(temperature=0, max_tokens=48)
    before = spec.metrics()
    want = plain.chat(CHATS, greedy)
    got = spec.chat(CHATS, greedy)
    after = spec.metrics()
    for a, b in zip(want, got, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and a.outputs[0].text == b.outputs[0].text
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
    drafted = after["spec_decode_draft_tokens_total"] - before["spec_decode_draft_tokens_total"]
    kept = after["spec_decode_accepted_tokens_total"] - before["spec_decode_accepted_tokens_total"]
    assert drafted > 0 and kept >= drafted // 2, (drafted, kept)  # quoting: most drafts hold
    generated = sum(len(o.outputs[0].token_ids) for o in got)
    assert after["generation_tokens_total"] - before["generation_tokens_total"] == generated
    again = spec.chat(CHATS, greedy)  # the verified blocks are in the prefix cache now: same answers
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in want]
    assert all(o.num_cached_tokens > 0 for o in again)
    assert_pool_empty(spec)


def test_stops_and_limits_cut_inside_the_kept_drafts(pair: tuple[LLM, LLM]) -> None:
    """Each limit and stop is a row of its own in one batch: a row's drafts and its cut are its own,
    and a decode step of the default model costs about the same for six rows as for one (a call per
    case took 60% longer)."""
    plain, spec = pair
    whole = plain.chat(CHATS[0], SamplingParams(temperature=0, max_tokens=16))[0].outputs[0]
    ids = whole.token_ids
    limits = (1, 2, 3, 7, 13)  # max_tokens inside a run of kept drafts
    stop = ids[9]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in limits]
    params.append(SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop]))
    *limited, stopped = [o.outputs[0] for o in spec.chat([CHATS[0]] * len(params), params)]
    for n, got in zip(limits, limited, strict=True):
        assert got.token_ids == ids[:n] and got.finish_reason == "length", n
    assert stopped.token_ids == ids[: ids.index(stop) + 1] and stopped.stop_reason == stop
    strings = [
        SamplingParams(
            temperature=0, max_tokens=40, stop=[whole.text[30:38]], include_stop_str_in_output=keep
        )
        for keep in (False, True)
    ]
    want, got = plain.chat([CHATS[0]] * 2, strings), spec.chat([CHATS[0]] * 2, strings)
    for x, y in zip(want, got, strict=True):
        a, b = x.outputs[0], y.outputs[0]
        assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (
            b.token_ids, b.text, b.finish_reason, b.stop_reason,
        )  # fmt: skip
    assert_pool_empty(spec)


def test_rows_under_a_ban_step_beside_speculated_rows(pair: tuple[LLM, LLM]) -> None:
    """A row under ``min_tokens`` and one under a bad word sample one token a step beside rows that
    speculate, in the same steps: the bans cover the samplers' rows only, the speculated rows after
    them (a step of both once failed its requests with finish_reason "error", found by
    tests/test_engine_stateful.py)."""
    plain, spec = pair
    greedy = SamplingParams(temperature=0, max_tokens=24)
    banned = [
        SamplingParams(temperature=0, max_tokens=24, min_tokens=10, stop_token_ids=[13]),
        SamplingParams(temperature=0, max_tokens=24, bad_words=["the"]),
    ]
    chats, params = [CHATS[0]] * len(banned) + CHATS[1:], banned + [greedy] * (len(CHATS) - 1)
    want = plain.chat(chats, params)
    before = spec.metrics()
    got = spec.chat(chats, params)
    assert spec.metrics()["spec_decode_draft_tokens_total"] > before["spec_decode_draft_tokens_total"]
    for a, b in zip(want, got, strict=True):
        assert b.outputs[0].finish_reason in ("stop", "length"), b.error
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert_pool_empty(spec)


def test_sampling_with_a_seed_is_reproducible_and_n_samples_speculate(pair: tuple[LLM, LLM]) -> None:
    _, spec = pair
    params = SamplingParams(temperature=0.7, max_tokens=16, seed=5, n=3)  # drafts kept and refused
    one, two = spec.chat(CHATS[1], params)[0], spec.chat(CHATS[1], params)[0]
    assert [c.token_ids for c in one.outputs] == [c.token_ids for c in two.outputs]
    assert all(1 <= len(c.token_ids) <= 16 for c in one.outputs)
    # rows that keep logprobs or process their logits decode one token a step, with the others
    mixed = [
        SamplingParams(temperature=0, max_tokens=8, logprobs=2),
        SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=8),
    ]
    want, got = pair[0].chat([CHATS[0]] * 3, mixed), spec.chat([CHATS[0]] * 3, mixed)
    assert [o.outputs[0].token_ids for o in want] == [o.outputs[0].token_ids for o in got]
    first = got[0].outputs[0]
    assert first.logprobs is not None and len(first.logprobs) == len(first.token_ids)
    assert_pool_empty(spec)


def tiny(tmp_path: Path, **kw: object) -> LLM:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_CONFIG))
    return LLM(model=f"dummy:{path}", device="cpu", attention="cascade", progress=False, **kw)


@pytest.mark.parametrize("blocks", [24, 400])
def test_under_preemption_and_the_context_limit(tmp_path: Path, blocks: int) -> None:
    """A pool so small that sequences are preempted with drafts appended, and prompts that repeat (a
    random model's greedy outputs loop, so drafts hold); sequences near the context's end."""
    kw = dict(num_kv_blocks=blocks, max_num_batched_tokens=48, max_model_len=160)
    plain, spec = tiny(tmp_path, **kw), tiny(tmp_path, **kw, speculative_config={"num_speculative_tokens": 5})
    rng = np.random.default_rng(1)
    prompts = []
    for i in range(6):
        piece = rng.integers(100, 2000, size=5 + i).tolist()
        prompts.append({"prompt_token_ids": piece * (3 + i % 3)})
    params = [
        SamplingParams(temperature=0, max_tokens=None if i % 2 else 90, ignore_eos=True) for i in range(6)
    ]
    want, got = plain.generate(prompts, params), spec.generate(prompts, params)
    for a, b in zip(want, got, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
        assert len(a.prompt_token_ids) + len(b.outputs[0].token_ids) <= 160
    assert spec.metrics()["spec_decode_accepted_tokens_total"] > 0
    if blocks == 24:
        assert spec.metrics()["preemptions_total"] > 0
    assert_pool_empty(spec)


def test_an_abort_between_steps_leaves_no_draft_behind(tmp_path: Path) -> None:
    spec = tiny(tmp_path, num_kv_blocks=128, speculative_config={"num_speculative_tokens": 4})
    engine = spec.engine
    piece = list(range(300, 310))
    engine.add_request("a", None, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), piece * 4)
    engine.add_request("b", None, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), piece * 5)
    for _ in range(4):
        engine.step()
    seq = engine.requests["a"].sequences[0]
    assert seq.num_computed_tokens == len(seq.token_ids) - 1  # between steps no draft is appended
    engine.abort("a")
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    (b,) = [o for o in outs if o.request_id == "b"]
    assert len(b.outputs[0].token_ids) == 50
    assert_pool_empty(spec)


def test_sampled_outputs_keep_the_models_distribution(pair: tuple[LLM, LLM]) -> None:
    """At temperature 1, how often the first j tokens copy the text (the drafts' path) with speculation
    is the model's probability of those j tokens, within sampling noise (120 samples: n=120 of one
    seeded request, each sample drawing and speculating on its own; the prompt computed once, where
    120 requests each recomputed its last partial block: 60% of the rows, 6 CPU-seconds).

    The probability is exact: the product of the greedy tokens' probabilities, read from the plain
    engine's logprobs (they match its own samples' frequencies), so only one side carries noise. Each
    j = 3..6 may be off by 3 standard errors, sqrt(p (1 - p) / 120): at most 1.1% of correct engines
    fail (0.27% each, four comparisons). A rule that kept every draft would raise j >= 3 from about 7%
    to about 22% (measured), 6 standard errors away. (Each sample verifies its drafts on the CPU:
    about 0.08 s a sample.)"""
    kw = dict(dtype="float32", device="cpu", attention="cascade", num_kv_blocks=4096, progress=False)
    kw.update(max_num_seqs=512, max_num_batched_tokens=16384)
    spec = LLM(**kw, speculative_config=SPEC)
    greedy = SamplingParams(temperature=0, max_tokens=6, logprobs=0)
    copy = pair[0].chat(CHATS[0], greedy)[0].outputs[0]
    want = np.exp(np.cumsum([lp[t].logprob for t, lp in zip(copy.token_ids, copy.logprobs, strict=True)]))
    count = 120
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=0, n=count)
    outs = [c.token_ids for c in spec.chat(CHATS[0], params)[0].outputs]
    assert len(outs) == count
    got = np.array([sum(o[:j] == copy.token_ids[:j] for o in outs) / count for j in range(1, 7)])
    assert spec.metrics()["spec_decode_accepted_tokens_total"] > count // 6  # the drafts did run (43 here)
    errors = np.abs(got - want) / np.sqrt(want * (1 - want) / count)  # in standard errors
    assert (errors[2:] < 3).all(), (want, got)
    assert_pool_empty(spec)


def test_tensor_parallel_ranks_verify_the_same_drafts(tmp_path: Path) -> None:
    """Two gloo ranks: the drafts and their rows reach every rank with the step's inputs. (The tiny
    dummy model: its greedy outputs loop within 32 tokens, so drafts hold (9 here); the default
    model's ranks took ~10 CPU-seconds more to start and run.)"""
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(100 + 7 * i, 106 + 7 * i)) * 4} for i in range(2)]
    kw = dict(num_kv_blocks=128, max_num_batched_tokens=48)
    want = [o.outputs[0].token_ids for o in tiny(tmp_path, **kw).generate(prompts, greedy)]
    with tiny(tmp_path, tensor_parallel_size=2, speculative_config=SPEC, **kw) as tp:
        assert [o.outputs[0].token_ids for o in tp.generate(prompts, greedy)] == want
        assert tp.metrics()["spec_decode_accepted_tokens_total"] > 0
