"""The fast path of structured decoding: bounded repeats folded (the same masks as xgrammar's own
grammar at every step of random walks), and the step's bitmask buffers (persistent, alternating host
slots; the device apply against the plain-PyTorch reference on random masks of many shapes).
"""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixserve.sampling.structured_outputs import StructuredOutputs
from prefixserve.sampling.token_mask import apply_token_mask
from prefixserve.structured.bitmask import StepBitmasks, apply_bitmask_reference
from prefixserve.structured.grammars import MAX_WHITESPACE, GrammarCache, folded, parse
from prefixserve.structured.repeats import fold_repeats

xgr = pytest.importorskip("xgrammar")

CUDA = torch.cuda.is_available()


# ---- folding, on the text -------------------------------------------------------------------------
def test_fold_a_bounded_string_into_its_closing_quote() -> None:
    text = 'root ::= (("\\"" c{1, 3} "\\"" "!"))\nc ::= (([a-z]))\n'
    got = fold_repeats(text)
    assert got is not None
    rules = dict(line.split(" ::= ", 1) for line in got.splitlines())
    assert rules["root"] == '(("\\"" [a-z] root_fold1))'  # lo copies, then the chain
    assert rules["root_fold0"] == '(("\\"" "!"))'  # the rest of the sequence, once
    assert rules["root_fold1"] == "((root_fold0) | ([a-z] root_fold2))"
    assert rules["root_fold3"] == "((root_fold0))"
    assert rules["c"] == "(([a-z]))"


@pytest.mark.parametrize(
    "text",
    [
        'root ::= (("a" c{0, 3}))\nc ::= (([a-z]))\n',  # nothing after it: nothing to fold into
        'root ::= (("a" c{2, -1} "b"))\nc ::= (([a-z]))\n',  # unbounded
        'root ::= (("a" c{2, 2} "b"))\nc ::= (([a-z]))\n',  # exact count: no chain
        'root ::= (("a" r{0, 3} "b"))\nr ::= (("x" "y"))\n',  # not one character class
        'root ::= (("a" c{0, 300} "b"))\nc ::= (([a-z]))\n',  # past LIMIT
        "root ::= TagDispatch(...)\n",  # not read: left alone
        'root ::= (("a" c{0, 3} "b") | ("\\xe5" d))\nc ::= (([a-z]))\nd ::= (("x"))\n',  # a printed byte
    ],
)
def test_fold_leaves_what_it_does_not_fold(text: str) -> None:
    assert fold_repeats(text) is None


def test_fold_keeps_lookaheads_and_avoids_taken_names() -> None:
    text = 'root ::= (("a" c{0, 2} "b") | ("z")) (=("!"))\nroot_fold0 ::= (("q"))\nc ::= (([0-9]))\n'
    got = fold_repeats(text)
    assert got is not None
    rules = dict(line.split(" ::= ", 1) for line in got.splitlines())
    assert rules["root_fold0"] == '(("q"))'
    assert rules["root"] == '(("a" root_fold1) | ("z")) (=("!"))'
    assert rules["root_fold1"] == '(("b") | ([0-9] root_fold2))'


# ---- folding: the same masks ----------------------------------------------------------------------
RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "tag": {"type": "string", "minLength": 2, "maxLength": 5},
        "say": {"enum": ['he said "hi"', "名\\path"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 100},
    },
    "required": ["name", "tag", "say", "score"],
    "additionalProperties": False,
}
SCHEMA = {"type": "object", "properties": {"rows": {"type": "array", "items": RECORD, "minItems": 2}}}


@pytest.fixture(scope="module")
def tokenizer():
    from prefixserve.model.loader import load_tokenizer

    return load_tokenizer(None)


def _allowed(mask: torch.Tensor, vocab: int) -> list[int]:
    bits = (mask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.view(-1)[:vocab].nonzero().view(-1).tolist()


@pytest.mark.parametrize(
    "grammar",
    [
        lambda: xgr.Grammar.from_json_schema(json.dumps(SCHEMA), max_whitespace_cnt=MAX_WHITESPACE),
        lambda: xgr.Grammar.from_json_schema(json.dumps(SCHEMA), any_whitespace=False),
        lambda: xgr.Grammar.from_regex(r"[0-9]{2,4}-[ab]{3}x[a-z ]{0,12}\.([0-9]{1,3})?"),
        lambda: xgr.Grammar.from_ebnf('root ::= ("<" [a-c]{0,6} ">")+ "$"'),
    ],
    ids=["json", "json_compact", "regex", "ebnf"],
)
def test_folded_grammar_masks_equal_xgrammars_at_every_step(tokenizer, grammar) -> None:
    vocab = len(tokenizer)
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab, stop_token_ids=[tokenizer.eos_token_id]
    )
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    raw = grammar()
    fold = folded(raw)
    assert fold is not raw  # each has a bounded repeat with something after it
    compiled = [compiler.compile_grammar(raw), compiler.compile_grammar(fold)]
    masks = [xgr.allocate_token_bitmask(1, vocab) for _ in compiled]
    whitespace = [t for t in range(vocab) if tokenizer.decode([t]).isspace()]
    for seed in range(4):
        rng = random.Random(seed)
        matchers = [xgr.GrammarMatcher(c) for c in compiled]
        for step in range(60):
            for m, mask in zip(matchers, masks, strict=True):
                m.fill_next_token_bitmask(mask)
            assert torch.equal(masks[0], masks[1]), (seed, step)
            allowed = _allowed(masks[0][0], vocab)
            spaces = [t for t in whitespace if t in set(allowed)] if seed % 2 else []
            token = rng.choice(spaces or allowed)  # odd seeds: runs of whitespace where allowed
            assert all(m.accept_token(token) for m in matchers)
            if matchers[0].is_terminated():
                assert matchers[1].is_terminated()
                break


@pytest.mark.parametrize(
    ("schema", "strict"),
    [
        (
            {
                "type": "object",
                "properties": {"名字": {"type": "string", "maxLength": 3}},
                "required": ["名字"],
            },
            False,
        ),
        (
            {
                "type": "object",
                "properties": {"a": {"type": "string", "maxLength": 3}, "b": {"const": "naïve"}},
            },
            True,
        ),
    ],
)
def test_a_grammar_printed_with_bytes_is_not_folded(schema: dict, strict: bool) -> None:
    """xgrammar prints a code point below 0x100 and a lone UTF-8 byte (additional properties other
    than a non-ASCII name are matched byte by byte) alike, ``\\xNN``: such a grammar is compiled as
    it is, since its text would not read back as the same language."""
    raw = xgr.Grammar.from_json_schema(json.dumps(schema), strict_mode=strict, any_whitespace=False)
    assert folded(raw) is raw


@pytest.mark.parametrize("wrap", ["{}", '{{"a": {}}}'])
def test_a_bounded_string_takes_no_raw_control_character(wrap: str) -> None:
    """xgrammar 0.2.8 lets U+0000-U+001F into a string with minLength / maxLength raw, which JSON
    refuses; the engine's grammar takes the characters of xgrammar's unbounded strings there."""
    bounded = {"type": "string", "minLength": 1, "maxLength": 4}
    schema = bounded if wrap == "{}" else {"type": "object", "properties": {"a": bounded}}
    grammar = parse(StructuredOutputs(json=schema))
    for text, ok in (("ab", True), ("é€", True), ("a\x19b", False), ("\x00", False), ("a\tb", False)):
        assert xgr.testing._is_grammar_accept_string(grammar, wrap.format(f'"{text}"')) is ok, text


def test_grammar_cache_compiles_the_folded_grammar(tokenizer) -> None:
    cache = GrammarCache(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    compiled = cache.get(StructuredOutputs(json=SCHEMA))
    assert "_fold" in str(compiled.grammar)


# ---- the bitmask buffers --------------------------------------------------------------------------
def _random_mask(gen: torch.Generator, rows: int, vocab: int, words: int) -> torch.Tensor:
    bits = torch.rand(rows, words * 32, generator=gen) < 0.3
    bits[:, 0] = True
    bits[:, vocab:] = False
    weights = 1 << torch.arange(32, dtype=torch.int64)
    packed = (bits.view(rows, words, 32).long() * weights).sum(-1)
    return packed.where(packed < 2**31, packed - 2**32).to(torch.int32)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    rows=st.integers(1, 70),
    vocab=st.integers(1, 3000),
    pad=st.integers(0, 2),  # words beyond ceil(vocab / 32), as a padded model vocabulary has
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    data=st.data(),
)
def test_apply_token_mask_matches_the_reference(
    seed: int, rows: int, vocab: int, pad: int, dtype: torch.dtype, data: st.DataObject
) -> None:
    gen = torch.Generator().manual_seed(seed)
    mask = _random_mask(gen, rows, vocab, -(-vocab // 32) + pad)
    every = data.draw(st.booleans())
    picked = (
        list(range(rows)) if every else data.draw(st.lists(st.integers(0, rows - 1), unique=True).map(sorted))
    )
    logits = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype)
    want = logits.clone()
    apply_bitmask_reference(want, mask, picked)
    with torch.inference_mode():
        got = logits.clone()
    apply_token_mask(got, mask, None if every else torch.tensor(picked, dtype=torch.int64))
    assert torch.equal(want, got)


def test_step_bitmasks_reuse_two_slots_and_grow() -> None:
    masks = StepBitmasks(words=4, device="cpu", rows=3)
    a, b, c = masks.host(3), masks.host(2), masks.host(3)
    assert a.data_ptr() == c.data_ptr() != b.data_ptr()  # the slots alternate, nothing new per step
    d = masks.host(5)  # more sample rows than sized for: regrown
    assert d.shape == (5, 4) and masks.rows == 6


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="no GPU"))]
)
def test_step_bitmasks_apply_each_step_its_own_mask(device: str) -> None:
    """Steps issued back to back without waiting (as launched ahead): each gets its own mask, though
    its host slot is refilled two steps later."""
    gen = torch.Generator().manual_seed(0)
    vocab, words = 1000, 32
    masks = StepBitmasks(words, device, rows=8)
    wants, gots = [], []
    for step in range(6):
        n = 8 - step % 3
        rows = list(range(n)) if step % 2 else sorted(random.Random(step).sample(range(n), 3))
        host = masks.host(n)
        host.copy_(_random_mask(gen, n, vocab, words))
        logits = torch.randn(n, vocab, generator=gen)
        want = logits.clone()
        apply_bitmask_reference(want, host.clone(), rows)
        with torch.inference_mode():
            got = logits.to(device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
        masks.apply(got, host, rows)
        wants.append(want if device == "cpu" else want.to(torch.bfloat16))
        gots.append(got)
    for want, got in zip(wants, gots, strict=True):
        assert torch.equal(want, got.cpu())


def test_a_step_fills_on_one_thread_up_to_the_fanout_rows_and_on_the_threads_past_them(tokenizer) -> None:
    """``FillThreads``: the same mask either way, one thread up to ``FANOUT_ROWS`` rows (threads cost
    more than a short fill), the threads past them; rows in different states."""
    from prefixserve.structured.matcher_process import FillThreads

    vocab = len(tokenizer)
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab, stop_token_ids=[tokenizer.eos_token_id]
    )
    compiled = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False).compile_grammar(
        xgr.Grammar.from_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    )
    rows = FillThreads.FANOUT_ROWS + 3
    rng, probe = random.Random(0), xgr.allocate_token_bitmask(1, vocab)
    matchers = []
    for r in range(rows):  # row r has taken r % 7 tokens
        m = xgr.GrammarMatcher(compiled)
        for _ in range(r % 7):
            m.fill_next_token_bitmask(probe)
            allowed = [t for t in _allowed(probe[0], vocab) if t != tokenizer.eos_token_id]
            if not allowed:  # the object closed: only the stop token is left
                break
            assert m.accept_token(rng.choice(allowed))
        matchers.append(m)
    fills = FillThreads(xgr, 4)
    used = []
    for name in ("one", "many"):
        batch = getattr(fills, name)
        real = batch.batch_fill_next_token_bitmask
        spy = lambda *a, n=name, f=real: (used.append(n), f(*a))  # noqa: E731
        setattr(fills, name, SimpleNamespace(batch_fill_next_token_bitmask=spy))
    masks = []
    for count in (FillThreads.FANOUT_ROWS, rows):
        mask = xgr.allocate_token_bitmask(rows, vocab)
        fills.fill(matchers[:count], mask, list(range(count)))
        masks.append(mask)
    assert used == ["one", "many"]
    assert torch.equal(masks[0][: FillThreads.FANOUT_ROWS], masks[1][: FillThreads.FANOUT_ROWS])
    for r in (0, 5, rows - 1):  # each row's mask is its own matcher's
        matchers[r].fill_next_token_bitmask(probe)
        assert torch.equal(masks[1][r], probe[0])
    single = FillThreads(xgr, 1)
    assert single.many is single.one  # one thread asked for: no second matcher


def test_a_slow_fill_sends_the_next_to_the_threads_until_one_is_quick(monkeypatch) -> None:
    """``FillThreads`` times each fill (a fake clock here, advanced by the fake fills): a step whose
    fill took longer than ``SLOW_SECONDS`` (rows in a costly grammar state, which lasts some tokens)
    sends the next step's to xgrammar's threads; a quick one there brings the next back to one."""
    from prefixserve.structured import matcher_process
    from prefixserve.structured.matcher_process import FillThreads

    now = [0.0]
    monkeypatch.setattr(matcher_process, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    fills = FillThreads(SimpleNamespace(BatchGrammarMatcher=lambda max_threads: None), 4)
    used, costs = [], []

    def fill(name: str) -> SimpleNamespace:
        def run(*_: object) -> None:
            used.append(name)
            now[0] += costs.pop(0)

        return SimpleNamespace(batch_fill_next_token_bitmask=run)

    fills.one, fills.many = fill("one"), fill("many")
    slow, quick = 2 * FillThreads.SLOW_SECONDS, FillThreads.SLOW_SECONDS / 4
    costs[:] = [quick, slow, slow, quick, quick]
    for _ in range(5):
        fills.fill([], None, [0])
    assert used == ["one", "one", "many", "many", "one"]


@pytest.mark.parametrize("memfd", [True, False])
def test_shared_slots_are_one_memory_through_their_descriptor(monkeypatch, memfd: bool) -> None:
    """``SharedSlots``: what one mapping writes, another mapping of its descriptor (the matcher
    process's) reads, slots and fill flags, with ``memfd_create`` or without it (an unlinked
    temporary file)."""
    import os

    from prefixserve.structured.bitmask import SharedSlots

    if not memfd:
        monkeypatch.delattr(os, "memfd_create", raising=False)
    slots = SharedSlots(3, 5)
    other, flags = SharedSlots.open(os.dup(slots.fd), *slots.describe())
    slots.tensor[1, 2] = torch.arange(5, dtype=torch.int32)
    assert torch.equal(other[1, 2], torch.arange(5, dtype=torch.int32)) and other.shape == (2, 3, 5)
    other[0, 0, 0] = 7
    assert int(slots.tensor[0, 0, 0]) == 7
    flags[1] = 2**40 + 3  # past the slots, 64 bits wide
    assert int(slots.flags[1]) == 2**40 + 3 and int(slots.flags[0]) == 0 and int(slots.tensor[1, 2, 4]) == 4


def test_a_step_with_the_last_fills_samplers_reuses_its_rows_less_those_finished() -> None:
    """``StructuredDecoding._rows``: the constrained samplers' (row, sequence, key), a matcher made at a
    sequence's first; the same samplers again (most decode steps) give the same rows without a pass
    over their requests, less sequences finished since; other samplers are looked at afresh."""
    from prefixserve.sequence import SeqStatus
    from prefixserve.structured.decoding import MATCHERS, StructuredDecoding

    spec = StructuredOutputs(regex="[ab]+")
    made: list[int] = []

    def matcher(_spec: StructuredOutputs) -> SimpleNamespace:
        made.append(len(made) + 100)
        return SimpleNamespace(key=made[-1])

    def seq(constrained: bool) -> SimpleNamespace:
        params = SimpleNamespace(structured_outputs=spec if constrained else None)
        request = SimpleNamespace(params=params, rules={MATCHERS: {}} if constrained else {})
        return SimpleNamespace(request=request, index=0, status=SeqStatus.RUNNING, is_finished=False)

    state = SimpleNamespace(matchers=SimpleNamespace(matcher=matcher), _last_rows=None)
    samplers = [seq(True), seq(False), seq(True), seq(True)]
    first = StructuredDecoding._rows(state, samplers)
    assert [(i, k) for i, _, k in first] == [(0, 100), (2, 101), (3, 102)]
    samplers[2].request.rules[MATCHERS].clear()  # a pass over the requests would make a new matcher
    samplers[3].is_finished = True
    again = StructuredDecoding._rows(state, list(samplers))  # the same sequences, in a new list
    assert [(i, k) for i, _, k in again] == [(0, 100), (2, 101)] and made == [100, 101, 102]
    fresh = StructuredDecoding._rows(state, samplers[:3])  # other samplers: each request looked at
    assert [(i, k) for i, _, k in fresh] == [(0, 100), (2, 103)]
