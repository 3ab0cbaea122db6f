"""A step's parameter flags: what the sampling checks ask of all its rows, or-ed once as the step's
rows are gathered (``RowParams``) instead of read from every row by each check. They must be what
the rows themselves say, for any mix of parameters, through every step of a run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixserve import LLM, SamplingParams
from prefixserve.sampling.params import (
    BAD_WORDS,
    MIN_TOKENS,
    NOT_ARGMAX,
    PROCESSES_LOGITS,
    RowParams,
    flags_of,
)

PARAMS = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.7]),
    max_tokens=st.just(6),
    min_tokens=st.sampled_from([0, 2]),
    logprobs=st.sampled_from([None, 1]),
    presence_penalty=st.sampled_from([0.0, 0.5]),
    logit_bias=st.sampled_from([None, {5: 1.0}]),
    allowed_token_ids=st.sampled_from([None, list(range(40, 300))]),
    bad_words=st.sampled_from([None, ["the"]]),
    seed=st.just(1),
)


@pytest.fixture(scope="module")
def tiny_llm(tiny_config_path: Path) -> LLM:
    return LLM(model=f"dummy:{tiny_config_path}", device="cpu", num_kv_blocks=256, progress=False)


def _by_rows(params: list[SamplingParams]) -> int:
    """The flags as the checks read them from each row before."""
    return (
        (MIN_TOKENS if any(p.min_tokens for p in params) else 0)
        | (BAD_WORDS if any(p.bad_words for p in params) else 0)
        | (PROCESSES_LOGITS if any(p.processes_logits for p in params) else 0)
        | (
            NOT_ARGMAX
            if not all(p.greedy and not p.wants_chosen_logprobs and not p.processes_logits for p in params)
            else 0
        )
    )


@given(st.lists(PARAMS, max_size=6))
def test_flags_of_a_list_are_its_rows(params: list[SamplingParams]) -> None:
    assert flags_of(params) == _by_rows(params)


@settings(max_examples=8, deadline=None)
@given(st.lists(PARAMS, min_size=1, max_size=5))
def test_every_steps_flags_are_its_rows(tiny_llm: LLM, params: list[SamplingParams]) -> None:
    runner = tiny_llm.engine.runner
    seen: list[int] = []
    original = runner.sample

    def checked(launch: Any, rows: list[int], step_params: Any, *rest: Any, **kw: Any) -> None:
        if rows:
            assert isinstance(step_params, RowParams)
            assert step_params.flags == _by_rows(list(step_params))
            seen.append(step_params.flags)
        original(launch, rows, step_params, *rest, **kw)

    runner.sample = checked  # type: ignore[method-assign]
    try:
        prompts = [f"Question {i}: where is the harbour?" for i in range(len(params))]
        tiny_llm.generate(prompts, params)
    finally:
        del runner.sample
    assert seen
