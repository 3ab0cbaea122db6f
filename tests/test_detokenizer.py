"""Incremental detokenization: exactly ``tokenizer.decode(ids, skip_special_tokens=True)``, grown per token.

Unit tests feed random ids (any vocab id, single-byte tokens that build or break multi-byte UTF-8
characters, CJK / emoji / accented pieces, special tokens) one at a time and in chunks. Engine tests
check that stop strings cut exactly where the old whole-output re-decode every step cut.
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from prefixserve import LLM, SamplingParams
from prefixserve.detokenizer import WINDOW, IncrementalDetokenizer, make_decode
from prefixserve.model.loader import convert_gguf, default_gguf_path, load_tokenizer

VOCAB = 49152
SAMPLES = [
    "中文",
    "日本語のテキスト",
    "🎉",
    "👨‍👩‍👧",
    "Ünïcödé",
    "naïve café",
    "✓ ok",
    "한국어",
    "𝔘𝔫𝔦",
    " ¿Qué?",
]
HYPO = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _byte_alphabet() -> dict[int, str]:
    """GPT-2 byte-level BPE: the character each byte is spelled with."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


@pytest.fixture(scope="module")
def tok() -> Any:
    """The default model's tokenizer (byte-level BPE), loaded once for the module."""
    return load_tokenizer(convert_gguf(default_gguf_path(), progress=False))


@pytest.fixture(scope="module")
def pools(tok: Any) -> dict[str, list[int]]:
    byte_id = _byte_ids(tok)
    byte_ids = [byte_id[b] for b in sorted(byte_id)]
    special = sorted(i for i, t in tok.added_tokens_decoder.items() if t.special)
    assert special and 0 in special
    pieces = sorted({i for s in SAMPLES for i in tok.encode(s, add_special_tokens=False)})
    high = [byte_id[b] for b in sorted(byte_id) if b >= 0x80]
    return {"bytes": byte_ids, "high": high, "special": special, "pieces": pieces}


def _ids(draw: Any, pools: dict[str, list[int]], max_size: int = 80) -> list[int]:
    one = st.one_of(
        st.integers(0, VOCAB - 1),
        st.sampled_from(pools["bytes"]),
        st.sampled_from(pools["high"]),  # non-ASCII bytes: UTF-8 lead and continuation bytes
        st.sampled_from(pools["special"]),
        st.sampled_from(pools["pieces"]),
    )
    return draw(st.lists(one, max_size=max_size))


def _check_feed(tok: Any, ids: list[int], chunks: list[int]) -> IncrementalDetokenizer:
    """Feed ``ids`` in chunks of the given sizes (cycled); check every invariant after every chunk."""
    d = IncrementalDetokenizer(tok)
    deltas, i, k = [], 0, 0
    while i < len(ids):
        n = chunks[k % len(chunks)] if chunks else 1
        new = ids[i : i + n]
        deltas.append(d.add(new[0] if len(new) == 1 and k % 2 else new))
        i, k = i + len(new), k + 1
        want = tok.decode(ids[:i], skip_special_tokens=True)
        assert d.full_text == want
        # settled: all but a trailing run of U+FFFD (a long run settles its final ones, ``_settle_run``)
        assert want.startswith(d.text) and d.pending == want[len(d.text) :]
        assert set(d.pending) <= {"\ufffd"} and len(d.text) >= len(want.rstrip("\ufffd"))
        assert d.num_ids == i and d.num_chars == len(d.text)
        assert "".join(deltas) == d.text
    assert d.full_text == tok.decode(ids, skip_special_tokens=True)
    return d


@HYPO
@given(data=st.data())
def test_one_token_at_a_time_matches_decode(tok: Any, pools: dict[str, list[int]], data: Any) -> None:
    _check_feed(tok, _ids(data.draw, pools), [1])


@HYPO
@given(data=st.data(), chunks=st.lists(st.integers(1, 2 * WINDOW + 3), min_size=1, max_size=6))
def test_chunks_match_decode(tok: Any, pools: dict[str, list[int]], data: Any, chunks: list[int]) -> None:
    _check_feed(tok, _ids(data.draw, pools), chunks)


@HYPO
@given(text=st.text(max_size=60), cut=st.integers(0, 5))
@example(text="<|im_end|>", cut=0)  # hypothesis found it: a special token's own spelling
def test_encoded_unicode_text_round_trips(tok: Any, text: str, cut: int) -> None:
    """Any unicode text's own tokens (split multi-byte characters included), minus a few at the end.
    A text that spells a special token ("<|im_end|>") encodes to it, which the output skips."""
    ids = tok.encode(text, add_special_tokens=False)
    d = _check_feed(tok, ids, [1])
    if text == tok.decode(ids, skip_special_tokens=True):
        assert d.full_text == text
    _check_feed(tok, ids[: max(0, len(ids) - cut)], [3, 1])


@pytest.fixture(scope="module")
def sp_tok() -> Any:
    """A SentencePiece-style tokenizer (Llama 2's decoders, no byte fallback): the text's first space is
    stripped, so a window's first token decodes differently from the same token inside the text."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>", "▁", "▁▁", "▁hello", "▁world", "hi", ",", "▁中", "文", "!", "▁🎉"]
    t = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    t.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    t.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@HYPO
@given(
    ids=st.lists(st.integers(0, 12), max_size=60), chunks=st.lists(st.integers(1, 5), min_size=1, max_size=4)
)
def test_leading_space_decoders_match_decode(sp_tok: Any, ids: list[int], chunks: list[int]) -> None:
    assert sp_tok.decode([5, 6]) == "hello world" and sp_tok.decode([6]) == "world"
    _check_feed(sp_tok, ids, [1])
    _check_feed(sp_tok, ids, chunks)


def test_split_characters_are_held_back_then_emitted_whole(tok: Any, pools: dict[str, list[int]]) -> None:
    byte_id = _byte_ids(tok)
    d = IncrementalDetokenizer(tok)
    assert d.add(tok.encode("Hi", add_special_tokens=False)) == "Hi"
    for b in "🎉".encode()[:-1]:
        assert d.add(byte_id[b]) == ""  # an incomplete character: nothing settled yet
        assert d.text == "Hi" and d.pending == "\ufffd" * len(d.pending) != ""
    assert d.add(byte_id["🎉".encode()[-1]]) == "🎉" and d.pending == ""
    assert d.add(pools["special"]) == ""  # special tokens are skipped
    assert d.add(byte_id[0x80]) == ""  # a stray continuation byte: U+FFFD, held until text follows
    assert d.full_text == "Hi🎉\ufffd"
    assert d.add(tok.encode(" end", add_special_tokens=False)) == "\ufffd end"
    assert d.text == d.full_text == "Hi🎉\ufffd end"


def test_decode_bypasses_the_wrapper_only_where_that_is_exact(tok: Any, monkeypatch: Any) -> None:
    ids = [*tok.encode("héllo 🎉", add_special_tokens=False), 0, 5]
    want = tok.decode(ids, skip_special_tokens=True)
    calls = []
    original = tok.decode

    def counting(*args: Any, **kwargs: Any) -> str:
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(tok, "decode", counting, raising=False)
    assert make_decode(tok)(ids) == want and not calls  # the Rust tokenizer's decode, called directly
    monkeypatch.setattr(tok, "clean_up_tokenization_spaces", True)
    assert make_decode(tok)(ids) == want and calls  # clean-up on: through tokenizer.decode
    assert make_decode(SimpleNamespace(decode=lambda ids, skip_special_tokens: "x"))([1]) == "x"


def test_window_stays_small(tok: Any) -> None:
    ids = tok.encode("The quick brown fox jumps over the lazy dog. 日本語 " * 40, add_special_tokens=False)
    d = IncrementalDetokenizer(tok)
    for t in ids:
        d.add(t)
        assert len(d._window) <= 2 * WINDOW
    assert d.full_text == tok.decode(ids)


def test_a_run_of_byte_fragments_keeps_the_window_small(tok: Any) -> None:
    """Tokens of bytes that never complete a character (a text ending in U+FFFD at every step) still
    cut the window: each step decodes a bounded window, not the whole run, and the text stays exact.
    Before, 64 rows of such a run cost 1.0 ms a step at 64 tokens and 3.4 ms at 256 (quadratic)."""
    byte_id = _byte_ids(tok)
    rng = random.Random(0)
    high = [byte_id[b] for b in range(0x80, 0x100) if b in byte_id]  # lead, continuation, invalid
    ids = [rng.choice(high) for _ in range(400)]
    ids[100:104] = [byte_id[b] for b in "🎉".encode()]  # a whole character inside the run
    d = IncrementalDetokenizer(tok)
    longest = 0
    for i, t in enumerate(ids):
        d.add(t)
        longest = max(longest, len(d._window))
        if i % 37 == 0 or i == len(ids) - 1:
            want = tok.decode(ids[: i + 1])
            assert d.full_text == want and want.startswith(d.text)
    assert longest <= 3 * WINDOW and len(d.pending) <= 2
    assert "🎉" in d.text
    d.add(tok.encode(" ok", add_special_tokens=False))
    assert d.text == d.full_text == tok.decode([*ids, *tok.encode(" ok", add_special_tokens=False)])


def test_a_run_is_not_cut_where_nothing_follows_an_open_character(tok: Any) -> None:
    """A cut needs a byte after it: ids that decode to nothing (a skipped special token) after an open
    lead byte prove nothing, and bytes after them still complete the character."""
    byte_id = _byte_ids(tok)
    ids = [byte_id[0x80]] * 15 + [byte_id[0xE2], 0, byte_id[0x82], byte_id[0xAC]]
    _check_feed(tok, ids, [1])
    _check_feed(tok, ids, [17, 1])
    assert tok.decode(ids, skip_special_tokens=True).endswith("\ufffd€")


def test_byte_fallback_runs_are_never_cut() -> None:
    """SentencePiece's byte fallback turns a run of ``<0xXX>`` pieces that is invalid anywhere into
    U+FFFD throughout, so a long run keeps its whole window: the text stays exact."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from prefixserve.detokenizer import cuts_runs

    pieces = ["<unk>", "▁", "▁hello", *(f"<0x{b:02X}>" for b in range(256))]
    t = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    t.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    sp = PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>")
    assert not cuts_runs(sp) and cuts_runs(load_tokenizer(convert_gguf(default_gguf_path(), progress=False)))
    ids = [3 + 0x80] * 16 + [3 + b for b in "€".encode()]
    assert sp.decode(ids) == "\ufffd" * 19  # the whole run, the euro's bytes included
    _check_feed(sp, ids, [1])


def test_text_from(tok: Any) -> None:
    d = IncrementalDetokenizer(tok)
    for piece in ["ab", "cd", "ef", "gh"]:
        d.add(tok.encode(piece, add_special_tokens=False))
    d.add(_byte_ids(tok)[0xE4])
    full = d.full_text
    assert full == "abcdefgh\ufffd"
    for start in range(len(full) + 2):
        assert d.text_from(start) == full[start:]


def _byte_ids(tok: Any) -> dict[int, int]:
    """Byte -> the id of its single-byte token (the vocab lacks a few never-seen bytes, e.g. 0xC0)."""
    vocab = tok.get_vocab()
    out = {b: vocab[c] for b, c in _byte_alphabet().items() if c in vocab}
    assert len(out) > 230 and all(b in out for b in (0x80, 0xBF, 0xC3, 0xE4, 0xF0))
    return out


def _stop_rule(text_of: Any, n: int, stops: list[str], min_tokens: int, include: bool) -> Any:
    """The rule by re-decoding everything: after each token k past min_tokens, the earliest stop string
    that ends past the first min_tokens tokens' settled text (their text less a trailing run of U+FFFD,
    which later bytes may still change), as vLLM searches only text generated past min_tokens; with
    min_tokens 0, the earliest anywhere."""
    mark = len(text_of(min_tokens).rstrip("\ufffd")) if min_tokens else 0
    for k in range(min_tokens + 1, n + 1):
        text = text_of(k)
        hits = [(at, s) for s in stops if (at := text.find(s, max(0, mark - len(s) + 1))) >= 0]
        if hits:
            at, stop = min(hits)
            return k, text[: at + len(stop) if include else at], stop
    return None


@HYPO
@given(data=st.data())
def test_find_first_matches_full_search(tok: Any, pools: dict[str, list[int]], data: Any) -> None:
    ids = _ids(data.draw, pools, max_size=60)
    full = tok.decode(ids, skip_special_tokens=True)
    spans = st.tuples(st.integers(0, max(0, len(full) - 1)), st.integers(1, 6))
    picked = [full[a : a + n] for a, n in data.draw(st.lists(spans, max_size=4))]
    extra = data.draw(
        st.lists(st.sampled_from(["\ufffd", "e", "🎉", "中", "zz", ". ", "\ufffd\ufffd"]), max_size=3)
    )
    stops = [s for s in picked + extra if s][:16]
    min_tokens = data.draw(st.integers(0, 10))
    include = data.draw(st.booleans())
    want = _stop_rule(
        lambda k: tok.decode(ids[:k], skip_special_tokens=True), len(ids), stops, min_tokens, include
    )
    d = IncrementalDetokenizer(tok)
    got = None
    for k, t in enumerate(ids, 1):
        d.add(t)
        if k == min_tokens:
            d.skip_search()  # what the engine's first stop check past min_tokens does
        if k > min_tokens and (hit := d.find_first(stops)) is not None:
            at, stop = hit
            got = k, d.full_text[: at + len(stop) if include else at], stop
            break
    assert got == want


# ---- the engine ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llm(tiny_config_path: Path) -> LLM:
    """A tiny random model whose logits favour byte tokens, special tokens and CJK / emoji pieces."""
    llm = LLM(
        model=f"dummy:{tiny_config_path}",
        dtype="float32",
        device="cpu",
        attention="reference",
        num_kv_blocks=512,
        progress=False,
    )
    tok = llm.engine.tokenizer
    assert tok is not None
    favoured = {i for b, i in _byte_ids(tok).items() if b >= 0x80} | set(range(17))
    favoured |= {i for s in SAMPLES for i in tok.encode(s, add_special_tokens=False)}
    bias = torch.zeros(VOCAB)
    bias[sorted(favoured)] = 5.0
    model = llm.engine.model
    logits = model.compute_logits
    model.compute_logits = lambda hidden, fp32=True: logits(hidden, fp32) + bias.to(hidden.device)
    return llm


def _assert_stop_rule(tok: Any, out: Any, params: SamplingParams) -> bool:
    """One completion ends where (and as) the re-decode-everything rule would have ended it."""
    ids = out.token_ids
    want = _stop_rule(
        lambda k: tok.decode(ids[:k], skip_special_tokens=True),
        len(ids),
        params.stop,
        params.min_tokens,
        params.include_stop_str_in_output,
    )
    if want is None:
        assert out.finish_reason == "length" and len(ids) == params.max_tokens
        assert out.text == tok.decode(ids, skip_special_tokens=True) and out.stop_reason is None
        return False
    k, text, stop = want
    assert (len(ids), out.text, out.stop_reason, out.finish_reason) == (k, text, stop, "stop")
    return True


def test_engine_stop_strings_cut_by_the_rule(tiny_llm: LLM) -> None:
    tok = tiny_llm.engine.tokenizer
    rng = random.Random(7)
    prompts = [
        {"prompt_token_ids": [rng.randrange(17, VOCAB) for _ in range(rng.randrange(1, 9))]}
        for _ in range(12)
    ]
    free_params = [SamplingParams(seed=i, max_tokens=40, ignore_eos=True) for i in range(len(prompts))]
    free = tiny_llm.generate(prompts, free_params)
    texts = [f.outputs[0].text for f in free]
    assert any("\ufffd" in t for t in texts)  # the bias makes split / invalid characters
    assert any(ord(c) > 0x2E80 for t in texts for c in t)  # and CJK / emoji
    for f in free:
        c = f.outputs[0]
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True) and c.finish_reason == "length"
    params = []
    for i, text in enumerate(texts):
        stops = []
        for _ in range(rng.randrange(1, 4)):
            at = rng.randrange(len(text)) if text else 0
            stops.append(text[at : at + rng.randrange(1, 5)] or "zz")
        if i % 3 == 0:
            stops.append("never in this text \x00")
        params.append(
            SamplingParams(
                seed=i,
                max_tokens=40,
                ignore_eos=True,
                stop=stops,
                min_tokens=rng.choice([0, 0, 3, 10]),
                include_stop_str_in_output=bool(i % 2),
                n=2 if i % 4 == 1 else 1,
            )
        )
    outs = tiny_llm.generate(prompts, params)
    stopped = 0
    for out, p in zip(outs, params, strict=True):
        for c in out.outputs:
            stopped += _assert_stop_rule(tok, c, p)
    assert stopped >= len(prompts) // 2
    assert not tiny_llm.engine.requests and tiny_llm.engine.pool.num_used == 0


def test_engine_streaming_text_is_the_settled_decode_less_the_stop_buffer(tiny_llm: LLM) -> None:
    """Each streamed (unfinished) text is the decode of the tokens so far without a half-received
    character's U+FFFD tail, less the longest stop string's length - 1 characters (vLLM's stop
    buffer: they may yet start a stop string and be cut); so each is a prefix of the next and of the
    final text, which is the whole decode or the text cut at its stop string."""
    tok = tiny_llm.engine.tokenizer
    free = tiny_llm.generate(
        {"prompt_token_ids": [500, 600]}, SamplingParams(seed=3, max_tokens=30, ignore_eos=True)
    )
    text = free[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2] or "zz"
    held = 0
    for params in (
        SamplingParams(seed=3, max_tokens=30, ignore_eos=True),
        SamplingParams(seed=3, max_tokens=30, ignore_eos=True, stop=[stop, "zzzz"]),
        SamplingParams(seed=3, max_tokens=30, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
    ):
        hold = 0 if params.include_stop_str_in_output else max(map(len, params.stop), default=1) - 1
        texts = []
        for out in tiny_llm.stream({"prompt_token_ids": [500, 600]}, params):
            c = out.outputs[0]
            texts.append(c.text)
            if not c.finished:
                settled = tok.decode(c.token_ids, skip_special_tokens=True).rstrip("\ufffd")
                assert c.text == settled[: len(settled) - hold]
                held += len(settled) > len(c.text)
        assert out.finished
        _assert_stop_rule(tok, c, params)
        assert all(b.startswith(a) for a, b in itertools.pairwise(texts)), texts
    assert held  # the bias makes split characters, and the stop buffer held some back
    # a stop buffer longer than the text so far holds all of it (a negative slice had let text through)
    for n in range(2, 24):
        params = SamplingParams(seed=3, max_tokens=6, ignore_eos=True, stop=["\x00" * n])
        outs = [o.outputs[0] for o in tiny_llm.stream({"prompt_token_ids": [500, 600]}, params)]
        for c in outs[:-1]:
            settled = tok.decode(c.token_ids, skip_special_tokens=True).rstrip("\ufffd")
            assert c.text == settled[: max(0, len(settled) - (n - 1))], n
        assert all(b.text.startswith(a.text) for a, b in itertools.pairwise(outs)), n


def test_engine_without_tokenizer_pays_nothing(tiny_llm: LLM) -> None:
    engine = tiny_llm.engine
    tok, engine.tokenizer = engine.tokenizer, None
    try:
        params = SamplingParams(seed=1, max_tokens=8, ignore_eos=True, stop=["a", "e", " "])
        req = engine.add_request("no-tok", params=params, prompt_token_ids=[100, 200], stream=True)
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
        assert outs and all(o.outputs[0].text == "" for o in outs)
        assert outs[-1].outputs[0].finish_reason == "length" and len(outs[-1].outputs[0].token_ids) == 8
        assert req.sequences[0].detokenizer is None
    finally:
        engine.tokenizer = tok


def test_a_stop_string_inside_min_tokens_does_not_cut_the_text(tiny_llm: LLM) -> None:
    """A stop string that shows up within the first min_tokens tokens is no stop, streamed or not: the
    sample goes on and its text stays the decode of its tokens (vLLM searches only text generated past
    min_tokens). It once stopped at min_tokens + 1 tokens with the text cut back to that occurrence."""
    tok = tiny_llm.engine.tokenizer
    prompt = {"prompt_token_ids": [500, 600]}
    ids = (
        tiny_llm.generate(prompt, SamplingParams(seed=3, max_tokens=30, ignore_eos=True))[0]
        .outputs[0]
        .token_ids
    )
    settled = [tok.decode(ids[:k], skip_special_tokens=True).rstrip("\ufffd") for k in range(1, 6)]
    k = next((k for k, text in enumerate(settled, 1) if len(text) >= 2), None)
    if k is None:
        pytest.skip("this tokenizer decodes the sample's first tokens to almost nothing")
    stop = settled[k - 1][-2:]  # ends within the first k <= 5 tokens' text
    for stream in (False, True):
        for min_tokens in (0, 8):
            params = SamplingParams(
                seed=3, max_tokens=30, ignore_eos=True, stop=[stop], min_tokens=min_tokens
            )
            if stream:
                *_, last = tiny_llm.stream(prompt, params)
            else:
                last = tiny_llm.generate(prompt, params)[0]
            c = last.outputs[0]
            stopped = _assert_stop_rule(tok, c, params)
            if min_tokens == 0:
                assert stopped and len(c.token_ids) <= k
            else:  # the rule above holds it to the text past min_tokens; it once stopped at 9 tokens
                assert len(c.token_ids) > min_tokens + 1 or not stopped


def test_detokenize_false_gives_the_same_tokens_and_no_text(tiny_llm: LLM) -> None:
    """vLLM's ``detokenize=False``: token ids alone (the host decodes nothing), the same ids as with
    text; stop strings, which are found in the text, need it on."""
    prompts = ["The weather", "A bicycle"]
    with_text = tiny_llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    ids_only = tiny_llm.generate(
        prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, detokenize=False)
    )
    for a, b in zip(with_text, ids_only, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids and a.outputs[0].text
        assert b.outputs[0].text == ""
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["."], detokenize=False)
