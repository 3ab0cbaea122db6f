"""The Python API's logprobs in vLLM's shape: a script written for vLLM's ``LLM.generate`` that reads
``CompletionOutput.logprobs`` and ``RequestOutput.prompt_logprobs`` (per position ``{token id:
Logprob(logprob, rank, decoded_token)}``) runs unchanged, and its values are the engine's own."""

from __future__ import annotations

import math

from prefixserve import LLM, Logprob, SamplingParams


def _vllm_style_report(llm: LLM, prompt: str) -> list[str]:
    """What a vLLM user writes (only the import differs)."""
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, prompt_logprobs=2)
    out = llm.generate([prompt], params)[0]
    lines = []
    for token_id, per_token in zip(out.outputs[0].token_ids, out.outputs[0].logprobs, strict=True):
        chosen = per_token[token_id]
        best = max(per_token.values(), key=lambda lp: lp.logprob)
        lines.append(
            f"{chosen.decoded_token!r} {chosen.logprob:.3f} rank={chosen.rank} best={best.decoded_token!r}"
        )
    for token_id, per_token in zip(out.prompt_token_ids, out.prompt_logprobs, strict=True):
        if per_token is None:  # the first prompt token has none
            continue
        lines.append(f"prompt {per_token[token_id].decoded_token!r} rank={per_token[token_id].rank}")
    return lines


def test_a_vllm_script_reads_the_logprobs(default_llm: LLM) -> None:
    lines = _vllm_style_report(default_llm, "The capital of France is")
    assert len(lines) >= 6 and all("None" not in line for line in lines[:6])  # decoded, greedy: ranked


def test_the_shapes_hold_the_engines_values(default_llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=5, logprobs=2, prompt_logprobs=1)
    out = default_llm.generate(["Once upon a time"], params)[0]
    c = out.outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == len(c.token_logprobs)
    tok = default_llm.get_tokenizer()
    for i, (tid, per_token) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
        assert isinstance(per_token[tid], Logprob)
        assert per_token[tid].logprob == c.token_logprobs[i]
        assert per_token[tid].rank == 1  # greedy: the chosen token is the top one
        assert next(iter(per_token)) == tid and len(per_token) <= 3  # the chosen token, then the top 2
        for t, (top_id, value) in enumerate(c.top_logprobs[i], 1):
            assert per_token[top_id].rank == t and math.isclose(per_token[top_id].logprob, value)
            assert per_token[top_id].decoded_token == tok.decode([top_id])
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for i, (tid, per_token) in enumerate(zip(out.prompt_token_ids, out.prompt_logprobs, strict=True)):
        if i == 0:
            continue
        assert per_token[tid].logprob == out.prompt_token_logprobs[i]
        assert per_token[tid].rank == out.prompt_logprob_ranks[i] >= 1
    no = default_llm.generate(["Hi"], SamplingParams(max_tokens=2))[0]
    assert no.outputs[0].logprobs is None and no.prompt_logprobs is None
