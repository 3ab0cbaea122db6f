"""Sampling filters, seeds, stop conditions and logprobs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prefixserve import LLM, SamplingParams
from prefixserve.sampling.sampler import _filtered_probs, sample


def test_filters_keep_only_allowed_tokens() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    top_k = _filtered_probs(logits, [SamplingParams(top_k=2)])
    assert (top_k[0, 2:] == 0).all() and torch.allclose(top_k.sum(), torch.tensor(1.0))
    top_p = _filtered_probs(logits, [SamplingParams(top_p=0.7)])  # 0.5 + 0.3 crosses 0.7
    assert (top_p[0, :2] > 0).all() and (top_p[0, 2:] == 0).all()
    min_p = _filtered_probs(logits, [SamplingParams(min_p=0.5)])  # keep p >= 0.25
    assert (min_p[0, :2] > 0).all() and (min_p[0, 2:] == 0).all()


def test_top_p_takes_what_top_k_and_min_p_kept() -> None:
    """vLLM's order: min-p and top-k first, then top-p over the renormalised rest (0.35 and 0.25 of
    [0.35, 0.25, 0.22, 0.18] are 0.58 and 0.42 then, so top_p 0.5 keeps the first alone; over the whole
    vocabulary it had kept both)."""
    logits = torch.log(torch.tensor([[0.35, 0.25, 0.22, 0.18]])).expand(2000, 4).clone()
    for params in (SamplingParams(top_k=2, top_p=0.5), SamplingParams(min_p=0.7, top_p=0.55)):
        probs = _filtered_probs(logits[:1], [params])
        assert probs[0, 0] == 1.0 and (probs[0, 1:] == 0).all(), params
        out = sample(logits, [params] * 2000, [None] * 2000, torch.Generator().manual_seed(5))
        assert set(out.tokens) == {0}, params  # the top-k candidates' path too
    loose = SamplingParams(top_k=3, top_p=0.9)  # (0.35 + 0.25) / 0.82 = 0.73 < 0.9: all three stay
    out = sample(logits, [loose] * 2000, [None] * 2000, torch.Generator().manual_seed(5))
    assert set(out.tokens) == {0, 1, 2}


def test_greedy_rows_and_seeded_rows_in_one_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0),
    ]
    gens = [None, torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)]
    out = sample(logits, params, gens, torch.Generator().manual_seed(0))
    assert out.tokens[0] == int(logits[0].argmax())
    again = sample(
        logits, params, [None, torch.Generator().manual_seed(3), None], torch.Generator().manual_seed(0)
    )
    assert again.tokens[1] == out.tokens[1]


def test_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().expand(4000, 3).clone()
    out = sample(
        logits, [SamplingParams(temperature=1.0)] * 4000, [None] * 4000, torch.Generator().manual_seed(1)
    )
    freq = torch.bincount(torch.tensor(out.tokens), minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n must"),
        ({"top_k": -5}, "top_k"),
        ({"top_k": 2**63}, "top_k"),  # had overflowed the sampler's tensor: every request of its step failed
        ({"stop": ["x"] * 17}, "stop strings"),
        ({"logprobs": 99}, "logprobs"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens must be <= max_tokens"),
    ],
)
def test_bad_sampling_params_are_named(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_vllm_spellings_of_off_and_defaults() -> None:
    """What vLLM's SamplingParams turns into its defaults is taken the same way (a None or True had
    passed the checks and then failed every request of its step)."""
    p = SamplingParams(stop_token_ids=None, seed=-1, logprobs=True, prompt_logprobs=True, top_k=-1)
    assert (p.stop_token_ids, p.seed, p.logprobs, p.prompt_logprobs, p.top_k) == ([], None, 1, 1, 0)
    assert SamplingParams(temperature=1e-40).temperature == 0.01  # raised, as vLLM: no overflow to NaN
    assert SamplingParams(temperature=0.0).greedy


def test_tiny_temperature_and_vllm_spellings_end_to_end(tiny_config_path: Path) -> None:
    llm = LLM(model=f"dummy:{tiny_config_path}", dtype="float32", num_kv_blocks=64, progress=False)
    prompts = [{"prompt_token_ids": list(range(10, 30))}, {"prompt_token_ids": [7, 8, 9]}]
    loose = SamplingParams(temperature=1e-40, stop_token_ids=None, logprobs=True, seed=-1)
    outs = llm.generate(prompts, loose)
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "length"]
    assert all(len(o.outputs[0].logprobs) == len(o.outputs[0].token_ids) for o in outs)
    assert all(0 not in o.outputs[0].token_ids for o in outs)  # NaN logits had picked token 0 each step


def test_seeded_generation_is_reproducible(tiny_config_path: Path) -> None:
    llm = LLM(model=f"dummy:{tiny_config_path}", dtype="float32", num_kv_blocks=64, progress=False)
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(10, 40))}
    a = llm.generate([prompt, prompt], params)
    b = llm.generate(prompt, params)
    assert a[0].outputs[0].token_ids == a[1].outputs[0].token_ids == b[0].outputs[0].token_ids
    other = llm.generate(
        prompt, SamplingParams(temperature=0.9, top_p=0.9, seed=99, max_tokens=16, ignore_eos=True)
    )
    assert other[0].outputs[0].token_ids != a[0].outputs[0].token_ids


def test_stop_strings_token_ids_and_logprobs(default_llm: LLM) -> None:
    conv = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
    free = default_llm.chat(conv, SamplingParams(temperature=0.0, max_tokens=40))[0].outputs[0]
    assert "5" in free.text
    cut = default_llm.chat(conv, SamplingParams(temperature=0.0, max_tokens=40, stop=["5"]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == "5"
    assert cut.text == free.text[: free.text.index("5")]
    stop_id = free.token_ids[3]
    by_id = default_llm.chat(conv, SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop_id]))[
        0
    ]
    assert by_id.outputs[0].token_ids == free.token_ids[:4] and by_id.outputs[0].stop_reason == stop_id
    lp = default_llm.chat(conv, SamplingParams(temperature=0.0, max_tokens=5, logprobs=3))[0].outputs[0]
    assert lp.logprobs is not None and len(lp.logprobs) == 5 and len(lp.top_logprobs[0]) == 3
    # Greedy: the chosen token is the top-1 token, and its logprob is the top-1 logprob.
    for tok, chosen, top in zip(lp.token_ids, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[0][0] == tok and abs(top[0][1] - chosen) < 1e-5 and chosen <= 0.0
    length = default_llm.chat(conv, SamplingParams(temperature=0.0, max_tokens=3))[0].outputs[0]
    assert length.finish_reason == "length" and len(length.token_ids) == 3


def test_greedy_argmax_over_model_dtype_logits_picks_the_fp32_winner() -> None:
    """All-greedy rows without logprobs skip the fp32 copy of the logits (``argmax_only``): the
    bf16 -> fp32 cast is exact, so the argmax, ties included (first index), is the same."""
    from prefixserve.sampling.sampler import argmax_only

    greedy = SamplingParams(temperature=0.0)
    assert argmax_only([greedy, greedy])
    assert not argmax_only([greedy, SamplingParams(temperature=0.0, logprobs=0)])
    assert not argmax_only([greedy, SamplingParams(temperature=0.7)])
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, 4099, generator=g) * 4).to(torch.bfloat16)  # bf16 rounding makes ties
    logits[3, 7] = logits[3, 9] = logits[3].max() + 1  # an exact tie: the first index wins
    params = [greedy] * logits.shape[0]
    low = sample(logits, params, [None] * len(params)).tokens
    full = sample(logits.float(), params, [None] * len(params)).tokens
    assert low == full
    assert low[3] == 7


def test_only_argmax_steps_skip_the_fp32_logits(tiny_config_path: Path) -> None:
    """The engine asks the model for model-dtype logits exactly when a step's rows are all greedy
    without logprobs; bf16 weights make the difference visible in the logits' dtype."""
    llm = LLM(model=f"dummy:{tiny_config_path}", dtype="bfloat16", num_kv_blocks=64, progress=False)
    model = llm.engine.model
    original, seen = model.compute_logits, []

    def recording(hidden, fp32=True):
        logits = original(hidden, fp32)
        seen.append((fp32, logits.dtype))
        return logits

    model.compute_logits = recording
    prompt = {"prompt_token_ids": list(range(10, 40))}
    llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert seen and all(s == (False, torch.bfloat16) for s in seen)
    seen.clear()
    llm.generate(prompt, SamplingParams(temperature=0.0, logprobs=2, max_tokens=3, ignore_eos=True))
    assert seen and all(s == (True, torch.float32) for s in seen)
    seen.clear()
    llm.generate(
        [prompt, prompt],
        [
            SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
            SamplingParams(temperature=0.8, seed=1, max_tokens=3, ignore_eos=True),
        ],
    )
    assert seen and all(s == (True, torch.float32) for s in seen)
