"""Greedy generations of the default model equal HF transformers' on the same GGUF (fp32)."""

from __future__ import annotations

import pytest
import torch

from prefixserve import LLM, SamplingParams
from tests.conftest import assert_pool_empty

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a hash table is.",
    "List three prime numbers greater than 50.",
    "Translate 'good morning' into Spanish and German.",
    "Give me a short tip for learning to play the guitar, with some detail about how to practise chords "
    "every day.",
    "Why is the sky blue?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
]
# past the prefill chunks of the batched test, so its steps mix prefill and decode: its 8 prompts (328
# tokens) are prefilled in 40-token chunks over steps 1-6 while the first ones decode, then 9 more
# steps only decode (16 tokens ran 6 more of those, and HF's generate 6 more tokens a prompt)
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def hf_greedy(default_llm: LLM, hf_gguf_model: torch.nn.Module) -> list[list[int]]:
    """HF transformers' greedy continuation of each chat prompt, one prompt at a time (no padding)."""
    model = hf_gguf_model
    tok = default_llm.get_tokenizer()
    outs = []
    for p in PROMPTS:
        ids = tok.encode(default_llm.render_chat([{"role": "user", "content": p}]), add_special_tokens=False)
        with torch.no_grad():
            gen = model.generate(
                torch.tensor([ids]),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=2,
                pad_token_id=2,
            )
        outs.append(gen[0, len(ids) :].tolist())
    return outs


def _chat(llm: LLM, prompts: list[str]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


def test_single_requests_match_hf(default_llm: LLM, hf_greedy: list[list[int]]) -> None:
    """Every other prompt alone (the batched test below runs all of them together: 1.5 s a prompt on
    the CPU, so the single requests take half)."""
    for prompt, expected in list(zip(PROMPTS, hf_greedy, strict=True))[::2]:
        assert _chat(default_llm, [prompt])[0] == expected, prompt
    assert_pool_empty(default_llm)


def test_batched_chunked_requests_match_hf(hf_greedy: list[list[int]]) -> None:
    # A small token budget forces chunked prefill, mixed prefill+decode steps and ragged batches.
    llm = LLM(
        dtype="float32",
        device="cpu",
        attention="reference",
        num_kv_blocks=256,
        max_num_batched_tokens=40,
        progress=False,
    )
    assert _chat(llm, PROMPTS) == hf_greedy
    assert_pool_empty(llm)
