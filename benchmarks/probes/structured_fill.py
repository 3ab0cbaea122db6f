"""Where a JSON-schema step's host time goes: xgrammar's mask fill per row, state by state.

The schema and workload are ``benchmarks/structured.py``'s (B rows, T tokens each). The rows' tokens
come from the default model on the CPU (``--walk model``: its greedy JSON-schema outputs) or from a
uniform pick among each step's allowed tokens (``--walk random``: what random weights do, whitespace
runs included). Each row's tokens are replayed through a matcher of the grammar as xgrammar builds
it (``raw``) and as ``GrammarCache`` compiles it (``folded``: bounded repeats folded,
``structured/repeats.py``), both ways of whitespace (free, ``compact``). Prints, per grammar:

- compile time; one row's fill per state kind (inside a string, after whitespace, elsewhere): mean
  and worst microseconds (masks checked equal between raw and folded at every step);
- the step's fill for all B rows (``batch_fill_next_token_bitmask``) at each ``--threads``: mean and
  worst milliseconds a step; creating B matchers; advancing B matchers by one token.

PYTHONPATH=. python -m benchmarks.probes.structured_fill [--walk model|random] [--batch 64] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import defaultdict
from typing import Any

import torch

from benchmarks.structured import SCHEMA


def _walks_model(batch: int, tokens: int, compact: bool) -> list[list[int]]:
    """The default model's greedy JSON-schema outputs on the CPU (the benchmark's prompts)."""
    from benchmarks.structured import _conversations
    from prefixserve import LLM, SamplingParams, StructuredOutputs

    llm = LLM(dtype="float32", device="cpu", max_num_seqs=max(batch, 8), progress=False)
    spec = StructuredOutputs(json=SCHEMA, disable_any_whitespace=compact)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, structured_outputs=spec)
    outs = llm.chat(_conversations(batch), params)
    return [list(o.outputs[0].token_ids) for o in outs]


def _allowed(mask: torch.Tensor, vocab: int) -> list[int]:
    bits = (mask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.view(-1)[:vocab].nonzero().view(-1).tolist()


def _walks_random(xgr: Any, compiled: Any, batch: int, tokens: int, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    mask = xgr.allocate_token_bitmask(1, vocab)
    walks = []
    for _ in range(batch):
        m, walk = xgr.GrammarMatcher(compiled), []
        while len(walk) < tokens and not m.is_terminated():
            m.fill_next_token_bitmask(mask)
            walk.append(rng.choice(_allowed(mask[0], vocab)))
            m.accept_token(walk[-1])
        walks.append(walk)
    return walks


def _kind(text: str) -> str:
    """Which state a row is in after ``text``: inside a string, after whitespace, or elsewhere."""
    quotes = len(text) - len(text.replace('\\"', "").replace('"', "")) - text.count('\\"')
    if quotes % 2:
        return "string"
    return "whitespace" if text[-1:].isspace() else "structure"


def _per_row(xgr: Any, grammars: dict[str, Any], walks: list[list[int]], tok: Any, vocab: int) -> None:
    times: dict[str, dict[str, list[float]]] = {g: defaultdict(list) for g in grammars}
    masks = {g: xgr.allocate_token_bitmask(1, vocab) for g in grammars}
    for walk in walks:
        matchers = {g: xgr.GrammarMatcher(c) for g, c in grammars.items()}
        for i, token in enumerate(walk):
            kind = _kind(tok.decode(walk[:i])) if i else "structure"
            for g, m in matchers.items():
                t0 = time.perf_counter()
                m.fill_next_token_bitmask(masks[g])
                times[g][kind].append(time.perf_counter() - t0)
                m.accept_token(token)
            first = next(iter(masks.values()))
            assert all(torch.equal(first, m) for m in masks.values()), "grammars disagree"
    print("one row's fill (us): state | visits | " + " | ".join(f"{g} mean / worst" for g in grammars))
    for kind in ("structure", "whitespace", "string"):
        n = len(times[next(iter(grammars))][kind])
        if n:
            cells = [
                f"{sum(v) / n * 1e6:8.1f} / {max(v) * 1e6:8.1f}" for v in (times[g][kind] for g in grammars)
            ]
            print(f"  {kind:10s} | {n:5d} | " + " | ".join(cells))


def _per_step(
    xgr: Any, grammars: dict[str, Any], walks: list[list[int]], vocab: int, threads: list[int]
) -> None:
    rows, steps = len(walks), max(len(w) for w in walks)
    mask = xgr.allocate_token_bitmask(rows, vocab)
    for g, compiled in grammars.items():
        t0 = time.perf_counter()
        created = [xgr.GrammarMatcher(compiled) for _ in walks]
        made = time.perf_counter() - t0
        cells = []
        for n in threads:
            batch = xgr.BatchGrammarMatcher(max_threads=n)
            matchers = [xgr.GrammarMatcher(compiled) for _ in walks]
            fills, accepts = [], []
            for step in range(steps):
                live = [i for i, w in enumerate(walks) if step < len(w)]
                t0 = time.perf_counter()
                batch.batch_fill_next_token_bitmask([matchers[i] for i in live], mask, live)
                fills.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                for i in live:
                    matchers[i].accept_token(walks[i][step])
                accepts.append(time.perf_counter() - t0)
            cells.append(f"{n} threads {sum(fills) / steps * 1e3:6.2f} / {max(fills) * 1e3:6.2f}")
        print(
            f"  {g:15s} | fill ms mean / worst: " + " | ".join(cells)
            + f" | {rows} matchers made {made * 1e3:.2f} ms | advanced {sum(accepts) / steps * 1e3:.2f} ms"
        )  # fmt: skip
        del created


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--walk", default="model", choices=["model", "random"])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args(argv)
    import xgrammar as xgr

    from prefixserve.model.loader import load_tokenizer
    from prefixserve.structured.grammars import MAX_WHITESPACE, folded

    tok = load_tokenizer(None)
    vocab = len(tok)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[tok.eos_token_id])
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    for compact in (False, True):
        ws: dict[str, Any] = {"any_whitespace": False} if compact else {"max_whitespace_cnt": MAX_WHITESPACE}
        grammar = xgr.Grammar.from_json_schema(json.dumps(SCHEMA), strict_mode=True, **ws)
        grammars, line = {}, []
        for name, g in (("raw", grammar), ("folded", folded(grammar))):
            t0 = time.perf_counter()
            grammars[name] = compiler.compile_grammar(g)
            line.append(f"{name} compiled in {(time.perf_counter() - t0) * 1e3:.0f} ms")
        if args.walk == "model":
            walks = _walks_model(args.batch, args.tokens, compact)
        else:
            walks = _walks_random(xgr, grammars["folded"], args.batch, args.tokens, vocab)
        print(f"\n== {'compact' if compact else 'free whitespace'} ({args.walk} walk, {len(walks)} rows x "
              f"{max(map(len, walks))} tokens): " + ", ".join(line))  # fmt: skip
        _per_row(xgr, grammars, walks, tok, vocab)
        print(f"{len(walks)} rows a step:")
        _per_step(xgr, grammars, walks, vocab, args.threads)


if __name__ == "__main__":
    main()
