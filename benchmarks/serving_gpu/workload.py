"""The requests: chats after a system prompt (Poisson arrivals), questions about one document, samples."""

from __future__ import annotations

import argparse
import random
from typing import Any

from benchmarks.harness.text import text_of_tokens


def system_prompt(tok: Any, n: int, seed: int) -> str:
    rng = random.Random(seed)
    head = "You are the support assistant of a cycling shop. Follow these house rules. "
    return head + text_of_tokens(tok, rng, max(1, n - len(tok.encode(head, add_special_tokens=False))))


def chat_requests(
    tok: Any,
    system: str,
    n: int,
    seed: int,
    args: argparse.Namespace,
    rate: float | None,
    logprobs: bool,
    stream: bool = True,
    tag: str = "",
) -> list[dict[str, Any]]:
    """``n`` chats after ``system``: user turns and output lengths uniform in their ranges, arrivals
    Poisson at ``rate`` (None: all at once). The same seed gives the same lengths and arrivals."""
    rng = random.Random(seed)
    lens = [(rng.randint(*args.user_tokens), rng.randint(*args.output_tokens)) for _ in range(n)]
    offsets, t = [], 0.0
    for _ in range(n):
        offsets.append(t)
        if rate is not None:
            t += rng.expovariate(rate)
    words = random.Random(f"{seed}-{tag}")
    out = []
    for i, ((user, gen), offset) in enumerate(zip(lens, offsets, strict=True)):
        head = f"Question {tag}{seed}-{i}: "
        text = head + text_of_tokens(
            tok, words, max(1, user - len(tok.encode(head, add_special_tokens=False)))
        )
        body = {
            "model": "default",
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": text}],
            "max_tokens": gen,
            "temperature": 0.0,
            "extra_body": {"ignore_eos": True},
        }
        out.append(
            {"i": i, "offset": offset, "kind": "chat", "stream": stream, "logprobs": logprobs, "body": body}
        )
    return out


def doc_requests(tok: Any, args: argparse.Namespace, seed: int) -> list[dict[str, Any]]:
    """One ``doc_tokens`` document, ``questions`` questions about it, all at once (completions)."""
    rng = random.Random(seed)
    doc = f"Document {seed}. " + text_of_tokens(tok, rng, args.doc_tokens)
    doc_tokens = len(tok.encode(doc, add_special_tokens=False))
    out = []
    for i in range(args.questions):
        q = f"Question {i}: " + text_of_tokens(tok, rng, args.question_tokens) + "?"
        body = {
            "model": "default",
            "prompt": f"{doc}\n\n{q}\nAnswer:",
            "max_tokens": args.gen,
            "temperature": 0.0,
            "extra_body": {"ignore_eos": True},
        }
        out.append(
            {"i": i, "offset": 0.0, "kind": "completion", "stream": False, "body": body, "doc": doc_tokens}
        )
    return out


def sample_requests(tok: Any, args: argparse.Namespace, seed: int) -> list[dict[str, Any]]:
    """``problems`` problems after one ``fewshot_tokens`` prefix, ``samples`` samples each (``n``)."""
    rng = random.Random(seed)
    fewshot = f"Worked examples {seed}. " + text_of_tokens(tok, rng, args.fewshot_tokens)
    out = []
    for i in range(args.problems):
        problem = f"Problem {i}: " + text_of_tokens(tok, rng, args.problem_tokens)
        body = {
            "model": "default",
            "prompt": f"{fewshot}\n\n{problem}\nSolution:",
            "max_tokens": args.gen,
            "n": args.samples,
            "temperature": 1.0,
            "seed": seed * 1000 + i,
            "extra_body": {"ignore_eos": True},
        }
        out.append({"i": i, "offset": 0.0, "kind": "completion", "stream": False, "body": body})
    return out
