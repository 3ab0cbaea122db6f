"""``min_tokens``: no EOS or stop token id among a sample's first ``min_tokens`` tokens (vLLM's rule).

The ban goes on the logits the choice is made from; the raw logits still give the logprobs. Rows
under a grammar are left to it. Checked on the rows a step bans, on the logits, and end to end on a
tiny random model whose logits are skewed towards the tokens banned.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from prefixserve import LLM, SamplingParams
from prefixserve.sampling.min_tokens import TokenBan, min_tokens_ban
from tests.conftest import assert_pool_empty

FAVOURED = 777  # a token id the skewed model all but always picks


def _seq(prompt_len: int) -> SimpleNamespace:
    return SimpleNamespace(num_prompt_tokens=prompt_len)


def test_rows_under_min_tokens_ban_their_stops() -> None:
    eos = {2, 5}
    p = SamplingParams(min_tokens=3, stop_token_ids=[9])
    # a 4-token prompt: the placeholder at index 4 + k is output token k + 1
    samplers, params = [_seq(4)] * 4, [p] * 4
    ban = min_tokens_ban(samplers, [4, 5, 6, 7], params, eos)
    assert ban is not None
    assert ban.rows == [0, 0, 0, 1, 1, 1, 2, 2, 2]  # output tokens 1-3 banned, the 4th free
    assert ban.ids == [2, 5, 9] * 3
    ignore = SamplingParams(min_tokens=3, stop_token_ids=[9], ignore_eos=True)
    assert min_tokens_ban([_seq(4)], [4], [ignore], eos).ids == [9]
    assert min_tokens_ban([_seq(4)], [4], [SamplingParams(min_tokens=3, ignore_eos=True)], eos) is None
    assert min_tokens_ban(samplers, [4, 5, 6, 7], [SamplingParams()] * 4, eos) is None
    grammar = SamplingParams(min_tokens=3, structured_outputs={"choice": ["yes", "no"]})
    assert min_tokens_ban([_seq(4)], [4], [grammar], eos) is None  # the grammar decides where it ends


def test_ban_sets_minus_inf_where_asked() -> None:
    logits = torch.randn(3, 10)
    want = logits.clone()
    TokenBan(rows=[0, 2, 2, 1], ids=[4, 0, 9, 12]).apply(logits)  # 12 is past the vocabulary: no token
    want[0, 4] = want[2, 0] = want[2, 9] = float("-inf")
    assert torch.equal(logits, want)


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def skewed_llm(tiny_config_path: Path, request: pytest.FixtureRequest) -> LLM:
    """The tiny random model with FAVOURED and EOS (2) far ahead of every other token, in its raw logits
    (on a GPU: decode steps under CUDA graphs, the logits eager after them)."""
    llm = LLM(
        model=f"dummy:{tiny_config_path}",
        dtype="float32",
        device=request.param,
        num_kv_blocks=256,
        progress=False,
    )
    bias = torch.zeros(llm.engine.model_config.vocab_size)
    bias[FAVOURED], bias[2] = 40.0, 30.0
    model = llm.engine.model
    logits = model.compute_logits

    def skewed(hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        out = logits(hidden, fp32)
        return out + bias.to(out.device, out.dtype)

    model.compute_logits = skewed
    return llm


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_no_stop_before_min_tokens(skewed_llm: LLM, async_scheduling: bool) -> None:
    engine = skewed_llm.engine
    engine.launch_ahead = engine.async_scheduling = async_scheduling
    engine._step_mode = engine._step_launch_ahead if async_scheduling else engine._step_sync
    prompts = [{"prompt_token_ids": [40, 41, 42]}, {"prompt_token_ids": [50] * 7}]
    tok = skewed_llm.get_tokenizer()
    for temperature in (0.0, 1.0):
        base = dict(max_tokens=12, temperature=temperature, seed=4, logprobs=1)
        stop_id = SamplingParams(**base, min_tokens=5, stop_token_ids=[FAVOURED], n=2)
        for out in skewed_llm.generate(prompts, stop_id):
            for c in out.outputs:
                assert c.token_ids[5] == FAVOURED and FAVOURED not in c.token_ids[:5], c.token_ids
                assert (len(c.token_ids), c.finish_reason, c.stop_reason) == (6, "stop", FAVOURED)
                assert 2 not in c.token_ids[:5]  # EOS is banned too, unless ignore_eos
                # the stop token's own text is left out of the text, as vLLM leaves it out
                assert c.text == tok.decode(c.token_ids[:-1], skip_special_tokens=True)
                for lp, top in zip(c.token_logprobs[:5], c.top_logprobs[:5], strict=True):
                    # the raw distribution: FAVOURED still on top, the chosen token far below it
                    assert top[0][0] == FAVOURED and top[0][1] > -1e-3 and lp < -20.0
        kept = SamplingParams(**base, stop_token_ids=[FAVOURED], include_stop_str_in_output=True)
        c = skewed_llm.generate(prompts[0], kept)[0].outputs[0]
        assert c.token_ids == [FAVOURED] and c.text == tok.decode([FAVOURED], skip_special_tokens=True)
        no_favoured = {FAVOURED: -100.0}  # EOS is the likeliest token then
        eos = SamplingParams(**base, min_tokens=4, logit_bias=no_favoured)
        c = skewed_llm.generate(prompts[0], eos)[0].outputs[0]
        assert (len(c.token_ids), c.token_ids[-1], c.finish_reason) == (5, 2, "stop")
        assert 2 not in c.token_ids[:4]
        free = SamplingParams(**base, min_tokens=4, ignore_eos=True, logit_bias=no_favoured)
        c = skewed_llm.generate(prompts[0], free)[0].outputs[0]
        assert c.token_ids[:4] == [2] * 4  # with ignore_eos, EOS is no stop: nothing to ban
    assert_pool_empty(skewed_llm)


def test_a_grammar_ends_where_it_must_despite_min_tokens(tiny_config_path: Path) -> None:
    """Under a grammar min_tokens bans nothing and its EOS stops the sample: a swallowed EOS had left
    the grammar's matcher terminated and every later token free, the output no longer matching."""
    pytest.importorskip("xgrammar")
    import re

    llm = LLM(
        model=f"dummy:{tiny_config_path}", dtype="float32", device="cpu", num_kv_blocks=64, progress=False
    )
    for min_tokens in (0, 10):
        p = SamplingParams(
            temperature=0.0, max_tokens=20, min_tokens=min_tokens, structured_outputs={"regex": "[a-c]{2,5}"}
        )
        c = llm.generate({"prompt_token_ids": [30, 260, 2644]}, p)[0].outputs[0]
        assert re.fullmatch("[a-c]{2,5}", c.text) and c.finish_reason == "stop", (min_tokens, c)
