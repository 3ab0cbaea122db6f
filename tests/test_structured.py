"""Structured outputs in the engine: specs checked, grammars cached, the bitmask against a plain-PyTorch
reference (masked tokens are never sampled), and constrained generation through the Python API on the
tiny dummy model, synchronous and launched ahead (outputs equal), with n > 1, stop strings, logprobs.

The engine tests share one synchronous engine and one launched ahead (``llms``): each engine's first
constrained request starts its matcher process, seconds of imports and set-up.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixserve import LLM, SamplingParams
from prefixserve.sampling.sampler import sample
from prefixserve.sampling.structured_outputs import StructuredOutputs
from prefixserve.structured.bitmask import apply_bitmask, apply_bitmask_reference
from prefixserve.structured.grammars import GrammarCache, check
from tests.conftest import assert_pool_empty, tiny_cascade_llm

xgr = pytest.importorskip("xgrammar")


# ---- specs ---------------------------------------------------------------------------------------
def test_exactly_one_constraint_and_field_names_in_errors() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs(regex="a", choice=["a"])
    with pytest.raises(ValueError, match=r"structured_outputs\.choice"):
        StructuredOutputs(choice=[])
    with pytest.raises(ValueError, match=r"structured_outputs\.json"):
        StructuredOutputs(json="{not json")
    assert StructuredOutputs(json='{"type": "object"}').json == {"type": "object"}
    params = SamplingParams(structured_outputs={"regex": "[ab]+"})
    assert params.structured_outputs == StructuredOutputs(regex="[ab]+")
    with pytest.raises(ValueError, match="unknown fields"):
        SamplingParams(structured_outputs={"guided_regex": "a"})
    with pytest.raises(ValueError, match=r"structured_outputs\.structural_tag"):
        StructuredOutputs(structural_tag="[1, 2]")


def test_the_older_structural_tag_form_vllm_takes() -> None:
    """``structures`` (begin, schema, end) with ``triggers``: free text, then a tagged JSON part."""
    from prefixserve.structured.grammars import parse

    tag = {"type": "structural_tag", "triggers": ["<f="],
           "structures": [{"begin": "<f=w>", "schema": {"type": "object"}, "end": "</f>"}]}  # fmt: skip
    grammar = parse(StructuredOutputs(structural_tag=tag))
    accepts = xgr.testing._is_grammar_accept_string
    assert accepts(grammar, 'free text <f=w>{"a": 1}</f> more text')
    assert not accepts(grammar, "free text <f=w>not json</f>")


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (StructuredOutputs(json={"type": "frobnicate"}), "structured_outputs.json: invalid JSON schema"),
        (StructuredOutputs(regex="a(b"), "structured_outputs.regex: invalid regex"),
        (StructuredOutputs(grammar='root ::= "a" | '), "structured_outputs.grammar: invalid grammar"),
        (StructuredOutputs(grammar='start ::= "a"'), "root"),
        (
            StructuredOutputs(structural_tag={"type": "structural_tag", "format": {"type": "nonsense"}}),
            "structured_outputs.structural_tag: invalid structural tag",
        ),
    ],
)
def test_bad_specs_are_refused_with_their_field(spec: StructuredOutputs, words: str) -> None:
    with pytest.raises(ValueError, match=re.escape(words)):
        check(spec)


@pytest.fixture(scope="module")
def tokenizer():  # the default model's tokenizer when installed, else the byte-level one
    from prefixserve.model.loader import load_tokenizer

    return load_tokenizer(None)


def test_grammar_cache_compiles_each_spec_once(tokenizer) -> None:
    cache = GrammarCache(tokenizer, 49152 + 64, [tokenizer.eos_token_id])  # a padded model vocabulary
    a = cache.get(StructuredOutputs(json={"type": "object", "properties": {"x": {"type": "integer"}}}))
    # the same schema with its keys in another order is the same spec
    b = cache.get(StructuredOutputs(json={"properties": {"x": {"type": "integer"}}, "type": "object"}))
    assert a is b and (cache.hits, cache.misses) == (1, 1)
    cache.get(StructuredOutputs(regex="[0-9]+"))
    cache.get(StructuredOutputs(regex="[0-9]+"))
    assert (cache.hits, cache.misses) == (2, 2)
    matcher = xgr.GrammarMatcher(a)
    mask = xgr.allocate_token_bitmask(1, 49152 + 64)
    matcher.fill_next_token_bitmask(mask)
    allowed = (mask[0, :, None] >> torch.arange(32)) & 1
    assert allowed.flatten()[49152:].sum() == 0  # padding rows of the logits are never allowed


# ---- the bitmask ---------------------------------------------------------------------------------
def _random_mask(gen: torch.Generator, rows: int, vocab: int) -> torch.Tensor:
    words = -(-vocab // 32)
    bits = torch.rand(rows, words * 32, generator=gen) < 0.05
    bits[:, 0] = True  # at least one allowed token per row
    bits[:, vocab:] = False
    weights = 1 << torch.arange(32, dtype=torch.int64)
    packed = (bits.view(rows, words, 32).long() * weights).sum(-1)
    return packed.to(torch.int64).where(packed < 2**31, packed - 2**32).to(torch.int32)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    rows=st.integers(1, 6),
    vocab=st.integers(33, 700),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    data=st.data(),
)
def test_bitmask_matches_the_reference_and_masked_tokens_are_never_sampled(
    seed: int, rows: int, vocab: int, dtype: torch.dtype, data: st.DataObject
) -> None:
    gen = torch.Generator().manual_seed(seed)
    mask = _random_mask(gen, rows, vocab)
    picked = data.draw(st.lists(st.integers(0, rows - 1), unique=True, min_size=1).map(sorted))
    logits = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype)
    want = logits.clone()
    with torch.inference_mode():  # as the engine's logits are: updated in place outside the mode
        got = logits.clone()
    apply_bitmask_reference(want, mask, picked)
    apply_bitmask(got, mask, picked)
    assert torch.equal(want, got)
    allowed = ((mask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).view(rows, -1)[:, :vocab].bool()
    for r in range(rows):
        if r not in picked:
            assert torch.equal(got[r], logits[r])
    params = data.draw(
        st.sampled_from(
            [
                SamplingParams(temperature=0.0),
                SamplingParams(temperature=1.0),
                SamplingParams(temperature=2.0, top_k=5),
                SamplingParams(temperature=0.7, top_p=0.5, logprobs=2),
                SamplingParams(temperature=1.0, min_p=0.1),
            ]
        )
    )
    result = sample(
        got.float(), [params] * rows, [torch.Generator().manual_seed(seed + r) for r in range(rows)]
    )
    for r in picked:
        assert allowed[r, result.tokens[r]], (r, result.tokens[r])


# ---- the engine ----------------------------------------------------------------------------------
SCHEMA = {
    "type": "object",
    "properties": {"kind": {"enum": ["cat", "dog"]}, "ok": {"type": "boolean"}},
    "required": ["kind", "ok"],
    "additionalProperties": False,
}
SPECS = [
    StructuredOutputs(choice=["alpha", "beta", "gamma delta"]),
    StructuredOutputs(regex=r"[0-9]{2,4}-[ab]{3}"),
    StructuredOutputs(json=SCHEMA, disable_any_whitespace=True),
    StructuredOutputs(grammar='root ::= "(" [xyz] ("," [xyz])* ")"'),
    StructuredOutputs(  # vLLM's structural tag, xgrammar's format form: a tagged part
        structural_tag={
            "type": "structural_tag",
            "format": {
                "type": "tag",
                "begin": "<n>",
                "content": {"type": "regex", "pattern": "[0-9]{2,4}"},
                "end": "</n>",
            },
        }
    ),
]


def _matches(spec: StructuredOutputs, text: str) -> bool:
    if spec.choice:
        return text in spec.choice
    if spec.regex:
        return re.fullmatch(spec.regex, text) is not None
    if spec.json:
        value = json.loads(text)
        return value["kind"] in ("cat", "dog") and isinstance(value["ok"], bool) and len(value) == 2
    if spec.structural_tag:
        return re.fullmatch(r"<n>[0-9]{2,4}</n>", text) is not None
    return re.fullmatch(r"\([xyz](,[xyz])*\)", text) is not None


def _run(llm, prompts: list[str], params: list[SamplingParams]) -> list[list[str]]:
    outs = llm.generate(prompts, params)
    return [[c.text for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def llms(tiny_config_path: Path) -> Iterator[dict[bool, LLM]]:
    """The tiny model's cascade engines by ``async_scheduling``: synchronous and launched ahead."""
    engines = {ahead: tiny_cascade_llm(tiny_config_path, async_scheduling=ahead) for ahead in (False, True)}
    yield engines
    for llm in engines.values():
        llm.shutdown()


@pytest.mark.parametrize("launch_ahead", [False, True])
def test_constrained_outputs_match_and_compose(llms: dict[bool, LLM], launch_ahead: bool) -> None:
    llm = llms[launch_ahead]
    assert llm.engine.launch_ahead is launch_ahead
    structured = llm.engine.structured  # set up at the engine's first constrained request
    misses = 0 if structured is None else structured.grammars.misses
    new = len(SPECS) if structured is None else sum(structured.grammars.cached(s) is None for s in SPECS)
    prompts, params = [], []
    for i, spec in enumerate(SPECS):
        for temperature in (0.0, 1.0):
            prompts.append(f"request {i} at {temperature}: answer")
            params.append(
                SamplingParams(temperature=temperature, seed=i, n=2, max_tokens=40, logprobs=2,
                               structured_outputs=spec)
            )  # fmt: skip
        prompts.append(f"unconstrained {i}")  # in the same batches
        params.append(SamplingParams(temperature=0.0, max_tokens=12))
    outs = llm.generate(prompts, params)
    for out, p in zip(outs, params, strict=True):
        for c in out.outputs:
            if p.structured_outputs is None:
                continue
            assert c.finish_reason == "stop", (c.text, p.structured_outputs)
            assert _matches(p.structured_outputs, c.text), (c.text, p.structured_outputs)
            assert len(c.logprobs) == len(c.token_ids)
            assert all(len(top) == 2 for top in c.top_logprobs)
    assert_pool_empty(llm)
    grammars = llm.engine.structured.grammars
    assert grammars.misses == misses + new  # each spec compiled once (all of them on a new engine)
    # the same requests again: same texts (seeded), every grammar from the cache
    again = llm.generate(prompts, params)
    assert [[c.text for c in o.outputs] for o in again] == [[c.text for c in o.outputs] for o in outs]
    assert grammars.misses == misses + new


def test_launch_ahead_equals_sync_and_unconstrained_greedy_is_unchanged(llms: dict[bool, LLM]) -> None:
    prompts = [f"prompt {i}" for i in range(6)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=SPECS[i % len(SPECS)])
        if i % 2 else SamplingParams(temperature=0.0, max_tokens=16)
        for i in range(6)
    ]  # fmt: skip
    plain = [SamplingParams(temperature=0.0, max_tokens=16) for _ in prompts]
    sync, ahead = llms[False], llms[True]
    before = _run(sync, prompts, plain)
    assert _run(sync, prompts, params) == _run(ahead, prompts, params)
    assert _run(sync, prompts, plain) == before == _run(ahead, prompts, plain)


def test_stop_string_cuts_a_constrained_output(llms: dict[bool, LLM]) -> None:
    llm = llms[True]
    spec = StructuredOutputs(regex=r"abc-[0-9]{1,3}")
    (out,) = llm.generate(
        ["x"], SamplingParams(temperature=0.0, max_tokens=20, stop=["-"], structured_outputs=spec)
    )
    assert out.outputs[0].text == "abc" and out.outputs[0].finish_reason == "stop"


def test_bad_spec_refused_at_add_request_and_engine_keeps_serving(llms: dict[bool, LLM]) -> None:
    llm = llms[False]
    with pytest.raises(ValueError, match=r"structured_outputs\.regex"):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputs(regex="(((")))
    assert not llm.engine.requests
    (out,) = llm.generate(["x"], SamplingParams(max_tokens=8, structured_outputs=SPECS[0]))
    assert out.outputs[0].text in SPECS[0].choice
    assert_pool_empty(llm)
