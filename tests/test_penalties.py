"""Penalties, logit_bias and allowed_token_ids (sampling/penalties.py, three request rules' adjusts): the
vectorized batch path equals a per-row plain reference; the device-kept counts are right under
launch-ahead; each control does what its definition says."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixserve import LLM, SamplingParams
from prefixserve.sampling.penalties import AllowedTokensRule, LogitBiasRule, PenaltiesRule
from prefixserve.sampling.rules import RuleSet
from tests.conftest import assert_pool_empty, tiny_cascade_llm


def reference(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """One row, token by token, straight from the definitions (vLLM's; OpenAI's presence/frequency)."""
    out = logits.clone()
    for t, b in (p.logit_bias or {}).items():
        out[t] += b
    if p.allowed_token_ids is not None:
        out[[t for t in range(len(out)) if t not in p.allowed_token_ids]] = float("-inf")
    counts = Counter(output)
    for t in set(prompt) | set(output):
        x = out[t].item()
        out[t] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
    for t, c in counts.items():
        out[t] -= p.frequency_penalty * c + p.presence_penalty
    return out


penalty = st.sampled_from([0.0, -2.0, -0.5, 0.3, 1.0, 2.0])
row = st.fixed_dictionaries(
    {
        "presence_penalty": penalty,
        "frequency_penalty": penalty,
        "repetition_penalty": st.sampled_from([1.0, 0.5, 1.3, 2.0]),
        "logit_bias": st.none() | st.dictionaries(st.integers(0, 30), st.floats(-100, 100), max_size=4),
        "allowed_token_ids": st.none() | st.lists(st.integers(0, 40), min_size=1, max_size=6),  # 31+: none
    }
)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            row,
            st.lists(st.integers(0, 30), min_size=1, max_size=12),
            st.lists(st.integers(0, 30), max_size=12),
        ),
        min_size=1,
        max_size=6,
    ),
    seed=st.integers(0, 2**31 - 1),
)
def test_batch_path_equals_per_row_reference(rows: list, seed: int) -> None:
    """Random logits, prompts and output histories: counts kept by ``PenaltyState`` (outputs recorded
    one sampled token at a time, as the runner records them) and the vectorized penalties give what
    the per-row reference gives."""
    vocab = 31
    g = torch.Generator().manual_seed(seed)
    params = [SamplingParams(**kw) for kw, _, _ in rows]
    prompts = [prompt for _, prompt, _ in rows]
    outputs = [out for _, _, out in rows]
    seqs = [_Seq(prompt) for prompt in prompts]
    penalties = PenaltiesRule()
    rules = RuleSet([LogitBiasRule(), AllowedTokensRule(), penalties])

    def processed(logits: torch.Tensor, live: list[int], tokens: list[int] | None) -> torch.Tensor:
        out = logits.clone()
        adjust = rules.adjust([seqs[i] for i in live], [params[i] for i in live])
        if adjust is not None:
            adjust.apply(out)
            if tokens is not None:  # the sampled tokens, as the runner hands them over
                adjust.sampled(torch.tensor(tokens))
        return out

    # every output token reaches the counts through ``sampled``, as sampled tokens do
    for step in range(max(map(len, outputs), default=0)):
        live = [i for i, out in enumerate(outputs) if step < len(out)]
        processed(torch.randn(len(live), vocab, generator=g), live, [outputs[i][step] for i in live])
    logits = torch.randn(len(rows), vocab, generator=g) * 5
    got = processed(logits, list(range(len(rows))), None)
    for r, p in enumerate(params):
        want = reference(logits[r], p, prompts[r], outputs[r] if p.needs_counts else [])
        torch.testing.assert_close(got[r], want, rtol=1e-5, atol=1e-4)
    for seq in seqs:
        seq.is_finished = True
    if penalties.state is not None:  # released once their sequences have ended
        penalties.state.release(lambda k: k.is_finished)
        assert len(penalties.state) == 0


class _Seq:
    """What the penalties read of a sequence: its prompt (outputs reach the counts as sampled)."""

    def __init__(self, prompt: list[int]) -> None:
        self.token_ids, self.num_prompt_tokens, self.is_finished = list(prompt), len(prompt), False


def _recording(llm: LLM) -> list[tuple[torch.Tensor, list[str]]]:
    """Record every processed sampling's raw logits and which request each row is for (the rows the
    rules' adjusts were asked for just before)."""
    runner, rules = llm.engine.runner, llm.engine.rules
    original, adjust, seen, last = runner._sample_processed, rules.adjust, [], []

    def rows_of(rows, params):
        last[:] = [s.request.request_id for s in rows]
        return adjust(rows, params)

    def recording(logits, params, generators, ban, adjusted):
        seen.append((logits.clone(), list(last)))
        return original(logits, params, generators, ban, adjusted)

    rules.adjust, runner._sample_processed = rows_of, recording
    return seen


# The tiny dummy model's logits are nearly flat (within ~0.1): a bias makes tokens 7, 9 and 11 the
# likeliest, so a greedy row repeats 7 unless a penalty pushes it off.
REPEAT = {7: 1.0, 9: 0.9, 11: 0.8}
CASES = [
    {"frequency_penalty": 2.0, "logit_bias": REPEAT},
    {"presence_penalty": 1.5, "logit_bias": REPEAT},
    {"repetition_penalty": 1.8, "logit_bias": REPEAT},
    {"frequency_penalty": -1.0, "presence_penalty": 0.5, "repetition_penalty": 0.7},
    {"logit_bias": {7: 5.0, 100: -3.0}},
    {},  # a plain row in the same batch
]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_tokens_are_argmax_of_reference_penalized_logits(
    tiny_config_path: Path, async_scheduling: bool
) -> None:
    """Greedy rows with penalties, batched with chunked prefill (and steps launched ahead): each
    token is the argmax of the raw logits penalized by the reference with the host's history. Under
    launch-ahead the previous token is still on the device when the next row is sampled."""
    llm = tiny_cascade_llm(tiny_config_path, async_scheduling)
    seen = _recording(llm)
    prompts = [
        {"prompt_token_ids": [(i * 7 + j) % 50 + 3 for j in range(40 + 9 * i)]} for i in range(len(CASES))
    ]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, **kw) for kw in CASES]
    outs = llm.generate(prompts, params)
    recorded = list(seen)
    unpenalized = [{"logit_bias": kw["logit_bias"]} if "logit_bias" in kw else {} for kw in CASES]
    plain = llm.generate(
        prompts, [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, **kw) for kw in unpenalized]
    )
    by_id = {o.request_id: (i, o) for i, o in enumerate(outs)}
    step_of: Counter[str] = Counter()
    checked = 0
    for logits, ids in recorded:
        for r, rid in enumerate(ids):
            i, out = by_id[rid]
            k = step_of[rid]
            step_of[rid] += 1
            tokens = out.outputs[0].token_ids
            if k >= len(tokens):
                continue  # a row launched ahead past the end (its token is dropped)
            want = reference(logits[r], params[i], prompts[i]["prompt_token_ids"], tokens[:k])
            assert int(want.argmax()) == tokens[k], (CASES[i], k)
            checked += 1
    assert checked == 24 * len(CASES)
    changed = [o.outputs[0].token_ids != p.outputs[0].token_ids for o, p in zip(outs, plain, strict=True)]
    assert changed == [True, True, True, True, False, False]  # the penalties bite; the rest are as before
    assert plain[0].outputs[0].token_ids == [7] * 24
    assert outs[-2].outputs[0].token_ids == [7] * 24
    assert_pool_empty(llm)


@pytest.mark.gpu
def test_engine_penalties_under_cuda_graphs_and_launch_ahead(tiny_config_path: Path) -> None:
    """On a GPU: decode steps replay CUDA graphs and launch ahead (the defaults there); the penalized
    tokens are still the argmax of the reference on the recorded raw logits."""
    llm = LLM(
        model=f"dummy:{tiny_config_path}", device="cuda", dtype="float32", num_kv_blocks=512, progress=False
    )
    assert llm.engine.launch_ahead and llm.engine.graphs is not None
    seen = _recording(llm)
    prompts = [
        {"prompt_token_ids": [(i * 7 + j) % 50 + 3 for j in range(40 + 9 * i)]} for i in range(len(CASES))
    ]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, **kw) for kw in CASES]
    outs = llm.generate(prompts, params)
    by_id = {o.request_id: (i, o) for i, o in enumerate(outs)}
    step_of: Counter[str] = Counter()
    checked = 0
    for logits, ids in seen:
        for r, rid in enumerate(ids):
            i, out = by_id[rid]
            k = step_of[rid]
            step_of[rid] += 1
            tokens = out.outputs[0].token_ids
            if k < len(tokens):
                want = reference(logits[r].cpu(), params[i], prompts[i]["prompt_token_ids"], tokens[:k])
                assert int(want.argmax()) == tokens[k], (CASES[i], k)
                checked += 1
    assert checked == 24 * len(CASES)
    assert outs[0].outputs[0].token_ids != [7] * 24  # the frequency penalty bites
    assert_pool_empty(llm)


def test_plain_requests_take_the_untouched_path(tiny_config_path: Path) -> None:
    """No penalty, no bias: the sampler's path is not entered and greedy outputs are unchanged."""
    llm = tiny_cascade_llm(tiny_config_path, async_scheduling=True)
    seen = _recording(llm)
    p = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, presence_penalty=0.0, logit_bias={})
    llm.generate({"prompt_token_ids": list(range(5, 30))}, p)
    assert seen == []
    assert llm.engine.rules.find("penalties").state is None


# ---- the default model, as the definitions say ------------------------------------------------


def test_minus_100_bias_never_emits_and_plus_100_always_emits(default_llm: LLM) -> None:
    prompt = "The capital of France is"
    base = default_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12))[0].outputs[0]
    banned, forced = base.token_ids[0], 1234
    params = [  # one batch: each row's bias is its own
        SamplingParams(
            temperature=temperature, seed=seed, max_tokens=12, logit_bias={banned: -100.0}, ignore_eos=True
        )
        for seed in range(3)
        for temperature in (0.0, 1.0)
    ]
    params.append(
        SamplingParams(temperature=1.0, seed=0, max_tokens=10, logit_bias={forced: 100.0}, ignore_eos=True)
    )
    *outs, forced_out = default_llm.generate([prompt] * len(params), params)
    for out in outs:
        assert banned not in out.outputs[0].token_ids
    assert forced_out.outputs[0].token_ids == [forced] * 10
    assert_pool_empty(default_llm)


def test_frequency_penalty_reduces_repeats(default_llm: LLM) -> None:
    prompt = "Repeat after me forever: la la la la la la la la la la la la"

    kws: list[dict[str, float]] = [{}, {"frequency_penalty": 1.0}, {"repetition_penalty": 1.5}]
    params = [SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, **kw) for kw in kws]
    outs = default_llm.generate([prompt] * len(params), params)  # one batch: penalties are per row
    plain, frequency, repetition = (
        len(ids) - len(set(ids)) for ids in (o.outputs[0].token_ids for o in outs)
    )
    assert plain >= 24  # the model repeats without a penalty
    assert frequency < plain
    assert repetition < plain


def test_best_of_returns_the_n_best_by_cumulative_logprob(default_llm: LLM) -> None:
    prompt = "Once upon a time"
    best = SamplingParams(temperature=1.0, seed=3, n=2, best_of=5, max_tokens=8, ignore_eos=True)
    out = default_llm.generate(prompt, best)[0]
    assert [c.index for c in out.outputs] == [0, 1]
    every = SamplingParams(temperature=1.0, seed=3, n=5, max_tokens=8, ignore_eos=True, logprobs=0)
    all5 = default_llm.generate(prompt, every)[0].outputs
    ranked = sorted(all5, key=lambda c: -c.cumulative_logprob)
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ranked[:2]]
    assert out.outputs[0].cumulative_logprob >= out.outputs[1].cumulative_logprob
    assert out.outputs[0].logprobs is None  # not asked for


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logit_bias": {5: 101.0}}, "logit_bias"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ],
)
def test_bad_values_name_the_field(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(temperature=1.0, **kw)


def test_bias_token_outside_the_vocabulary_is_refused(tiny_config_path: Path) -> None:
    llm = tiny_cascade_llm(tiny_config_path, async_scheduling=False)
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(logit_bias={49152: 1.0}))
    assert llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=2))[0].outputs[0].token_ids
