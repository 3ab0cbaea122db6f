"""How many long sequences one KV pool holds when sliding layers give their pages back (issue 100 item 4).

For one model (dummy weights at its shipped shape, bf16, default memory share), the engine starts twice
in one process: keeping every layer's KV of every block (``keep_sliding_kv=True``) and freeing the
sliding layers' pages behind the windows (the default, ``kv/layout.py``). For each:
  pool_GiB, pages      the pool's memory and its pages (blocks of the layout)
  pages_per_seq        what one sequence of --context prompt tokens plus --gen generated holds at most
  fit                  pool pages // pages_per_seq: the sequences of that length the pool holds at once
  measured             --seqs distinct prompts of --context tokens (default: fit + 2 of each layout)
                       run through the engine: the most that were past their prompt at once
  prefill_tok_s        prompt tokens over the run's wall time (the first layout's includes compiling)
and the ratios free over keep of ``fit`` and ``measured`` (target: >= 3x at 32K on Gemma-3-12B).

    PYTHONPATH=. python -m benchmarks.sliding_kv run [--model gemma-3-12b] [--context 32768] [--gen 1024]
    python -m benchmarks.sliding_kv report --json docs/benchmarks/sliding_kv.json
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from array import array
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import RESULTS, pyplot, run_info
from benchmarks.harness.output import run_or_report, write_json, write_text

NAME = "sliding_kv"


def _prompts(n: int, length: int, seed: int) -> list[array]:
    rng = random.Random(seed)
    return [array("q", [rng.randrange(1000, 30000) for _ in range(length)]) for _ in range(n)]


def _one(model: str, keep: bool, args: argparse.Namespace) -> dict[str, Any]:
    from prefixserve import LLM, SamplingParams

    llm = LLM(
        model=model,
        keep_sliding_kv=keep,
        max_model_len=args.context + args.gen,
        max_num_batched_tokens=args.max_batched,
        max_num_seqs=args.max_seqs,
        enable_prefix_caching=False,
        progress=False,
    )
    engine = llm.engine
    kv = engine.runner.kv
    pool_bytes = sum(t.numel() * t.element_size() for t in kv.slots)
    pages = engine.pool.num_blocks
    gen = args.gen  # long enough that every prompt is in before the first ends: the peak is memory's
    per_seq = engine.blocks.pages_for(args.context + gen)
    fit = pages // per_seq
    n = args.seqs or fit + 2
    params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    for i, ids in enumerate(_prompts(n, args.context, seed=int(keep))):
        engine.add_request(f"s{i}", params=params, prompt_token_ids=ids)
    peak, start = 0, time.perf_counter()
    while engine.requests:
        engine.step()
        running = engine.scheduler.running
        peak = max(peak, sum(s.num_computed_tokens >= s.num_prompt_tokens for s in running))
    took = time.perf_counter() - start
    row = {
        "layout": "keep" if keep else "free",
        "pool_GiB": pool_bytes / 2**30,
        "pages": pages,
        "pages_per_seq": per_seq,
        "fit": fit,
        "seqs": n,
        "gen": gen,
        "measured": peak,
        "preemptions": engine.scheduler.num_preemptions,
        "prefill_tok_s": n * args.context / took,
        "wall_s": took,
    }
    del engine, kv, llm
    gc.collect()
    torch.cuda.empty_cache()
    return row


def run(args: argparse.Namespace) -> None:
    model = f"dummy:{args.model}"
    result: dict[str, Any] = {
        **run_info(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("mode", "out")},
        "rows": [],
    }
    out = Path(args.out)
    for keep in (True, False):
        row = _one(model, keep, args)
        result["rows"].append(row)
        write_json(out / f"{NAME}.json", result)
        print(row, flush=True)
    report(result, out)


def report(result: dict[str, Any], out: Path) -> None:
    rows = {r["layout"]: r for r in result["rows"]}
    s = result["settings"]
    lines = [
        "# Sliding layers' KV given back: long sequences one pool holds",
        "",
        f"{result['device']}; torch {result['torch']}; commit {result['commit']}; {result['date']}; "
        f"{s['model']} (dummy weights, bf16); sequences of {s['context']} prompt tokens (distinct, prefix "
        f"cache off), each generating {s['gen']} tokens (every prompt is in before the first ends). "
        "Written by `benchmarks/sliding_kv.py`.",
        "",
        "| layout | pool GiB | pages | pages per sequence | fit at once | sequences run | most past their "
        "prompt at once | generated | preemptions | tok/s (prompt) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows.values():
        lines.append(
            f"| {r['layout']} | {r['pool_GiB']:.1f} | {r['pages']:,} | {r['pages_per_seq']:,} | {r['fit']} "
            f"| {r['seqs']} | {r['measured']} | {r['gen']} | {r['preemptions']} | {r['prefill_tok_s']:,.0f} |"
        )
    if "keep" in rows and "free" in rows:
        fit = rows["free"]["fit"] / max(rows["keep"]["fit"], 1)
        measured = rows["free"]["measured"] / max(rows["keep"]["measured"], 1)
        result["free_over_keep"] = {"fit": fit, "measured": measured}
        lines += [
            "",
            f"Free over keep: {fit:.2f}x the sequences that fit, {measured:.2f}x measured at once "
            "(target: >= 3x).",
        ]
    write_json(out / f"{NAME}.json", result)
    write_text(out, f"{NAME}.md", lines)
    plt = pyplot()
    if plt is None or not rows:
        return
    fig, ax = plt.subplots(figsize=(5, 3.5))
    names = list(rows)
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [rows[n]["fit"] for n in names], width=0.4, label="fit (pages)")
    ax.bar([i + 0.2 for i in x], [rows[n]["measured"] for n in names], width=0.4, label="measured at once")
    ax.set_xticks(list(x), names)
    ax.set_ylabel(f"sequences of {s['context'] // 1024}K tokens")
    ax.set_title(f"{s['model']} on {result['device']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / f"{NAME}.png", dpi=120)


def add_run_args(r: argparse.ArgumentParser) -> None:
    r.add_argument("--model", default="gemma-3-12b")
    r.add_argument("--context", type=int, default=32768)
    r.add_argument("--gen", type=int, default=1024, help="tokens each generates")
    r.add_argument("--seqs", type=int, default=0, help="prompts per layout (0: what fits, plus 2)")
    r.add_argument("--max-batched", type=int, default=8192)
    r.add_argument("--max-seqs", type=int, default=256)


if __name__ == "__main__":
    run_or_report(__doc__, NAME, RESULTS, add_run_args, run, report)
