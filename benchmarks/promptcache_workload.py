"""The Prompt Cache benchmark's workload: a schema of random-word modules, prompts importing some of
them (PML, and the same text plain in schema and in shuffled order), and one request's TTFT.

Apart from ``promptcache.py`` because the recovery benchmark (``recovery.py``) times the same prompts
and ``promptcache.py`` imports the recovery sections: each imports this, neither the other.
"""

from __future__ import annotations

import random
import time
from typing import Any

import torch

from prefixserve import LLM, SamplingParams

WORDS = [
    *[
        "river",
        "mountain",
        "quiet",
        "signal",
        "harbor",
        "copper",
        "lantern",
        "orchard",
        "violet",
        "engine",
        "garden",
        "silver",
        "market",
    ],
    *[
        "winter",
        "planet",
        "falcon",
        "meadow",
        "thunder",
        "canyon",
        "marble",
        "candle",
        "forest",
        "island",
        "shadow",
        "bridge",
    ],
    *[
        "desert",
        "velvet",
        "compass",
        "ember",
        "glacier",
        "pepper",
        "saddle",
        "timber",
        "walnut",
        "zephyr",
        "anchor",
        "beacon",
    ],
]


def words(rng: random.Random, tokenizer: Any, tokens: int) -> str:
    """Text of about ``tokens`` tokens (random words: no accidental structure for the cache to find)."""
    text = ""
    while len(tokenizer.encode(text, add_special_tokens=False)) < tokens:
        text += " " + " ".join(rng.choice(WORDS) for _ in range(max(1, tokens // 4)))
    ids = tokenizer.encode(text, add_special_tokens=False)[:tokens]
    return tokenizer.decode(ids).replace("<", " ").replace("&", " ")


def bench_schema(tokenizer: Any, modules: int, module_tokens: int, seed: int) -> tuple[str, list[str]]:
    rng = random.Random(seed)
    texts = [words(rng, tokenizer, module_tokens) for _ in range(modules)]
    body = "".join(f'<module name="m{i}">{t}</module>' for i, t in enumerate(texts))
    return f'<schema name="bench">{body}</schema>', texts


def prompts_for(rng: random.Random, texts: list[str], count: int, question: str) -> tuple[str, str, str]:
    """(PML prompt, plain prompt in schema order, plain prompt in shuffled order) importing ``count``."""
    picked = sorted(rng.sample(range(len(texts)), count))
    pml = '<prompt schema="bench">' + "".join(f"<m{i}/>" for i in picked) + question + "</prompt>"
    plain = "".join(texts[i] for i in picked) + question
    shuffled = picked[:]
    rng.shuffle(shuffled)
    return pml, plain, "".join(texts[i] for i in shuffled) + question


def ttft(llm: LLM, prompt: Any) -> float:
    if llm.engine.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    return time.perf_counter() - t0
