"""``TextTokens``: the leading tokens that wrote an output's first characters, counted incrementally
(two short decodes a token), against decoding every prefix whole, on random token ids (special tokens
and half characters included) and on encoded texts, for the byte-level tokenizer and the default
model's (where installed), skipping special tokens or not."""

from __future__ import annotations

import random

import pytest

from prefixserve.model.byte_tokenizer import byte_tokenizer
from prefixserve.model.loader import load_tokenizer
from prefixserve.protocols.openai.text_tokens import TextTokens

TEXTS = [
    "Voilà 🚲🚲 ok, naïve café — 東京",
    "<think>plan</think>\n\nAnswer: 42",
    "  lead\tspaces\n\nnew",
    "plain",
]


@pytest.mark.parametrize("which", ["bytes", "default"])
@pytest.mark.parametrize("skip", [True, False])
def test_incremental_lengths_match_whole_decodes(which: str, skip: bool) -> None:
    tok = byte_tokenizer() if which == "bytes" else load_tokenizer(None)  # bytes again without the package
    rng = random.Random(f"{which}-{skip}")
    for case in range(120):
        if case % 2:
            text = "".join(rng.choice(rng.choice(TEXTS)) for _ in range(rng.randint(0, 40)))
            ids = list(tok.encode(text, add_special_tokens=False))
        else:
            ids = [rng.randrange(len(tok)) for _ in range(rng.randint(0, 40))]
        counter = TextTokens(tok, skip)
        lengths = [len(tok.decode(ids[:k], skip_special_tokens=skip)) for k in range(len(ids) + 1)]
        chars = sorted(rng.randint(0, lengths[-1] + 2) for _ in range(4))
        for c in chars:  # within(): the most leading tokens whose text fits, asked for growing lengths
            k = counter.within(ids, c)
            assert all(n <= c for n in lengths[: k + 1]) and (k == len(ids) or lengths[k + 1] > c), (ids, c)
