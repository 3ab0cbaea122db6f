"""Prompts of a given token length: word salad cut at a token boundary (the same seed, the same text)."""

from __future__ import annotations

import random
from typing import Any

WORDS = [
    "bike",
    "wheel",
    "chain",
    "gear",
    "brake",
    "saddle",
    "pedal",
    "frame",
    "fork",
    "tyre",
    "spoke",
    "hub",
    "crank",
    "lever",
    "cable",
    "route",
    "climb",
    "descent",
    "weather",
    "map",
    "rain",
    "wind",
    "coffee",
    "repair",
    "pump",
    "valve",
    "tube",
    "patch",
    "light",
    "lock",
    "helmet",
    "jersey",
    "glove",
    "river",
    "bridge",
    "harbour",
    "lantern",
    "meadow",
    "orchard",
    "granite",
    "copper",
    "violet",
    "amber",
    "signal",
    "station",
    "market",
    "ledger",
    "invoice",
    "parcel",
    "courier",
    "ticket",
    "window",
    "garden",
    "kettle",
    "pepper",
    "thunder",
    "silver",
    "marble",
]


def words_text(rng: random.Random, count: int) -> str:
    out = []
    for i in range(count):
        out.append(rng.choice(WORDS))
        if i % 13 == 12:
            out[-1] += "."
    return " ".join(out)


def text_of_tokens(tok: Any, rng: random.Random, n: int) -> str:
    """About ``n`` tokens of word salad (cut at a token boundary, then decoded)."""
    text = words_text(rng, n + 8)
    ids = tok.encode(text, add_special_tokens=False)
    while len(ids) < n:
        text += " " + words_text(rng, n)
        ids = tok.encode(text, add_special_tokens=False)
    return str(tok.decode(ids[:n]))


def rendered_tokens(tok: Any, messages: list[dict[str, str]], generation: bool = False) -> int:
    if getattr(tok, "chat_template", None):
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
    else:
        text = "".join(m["content"] for m in messages)
    return len(tok.encode(text, add_special_tokens=False))
