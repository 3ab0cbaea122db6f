"""Probe: the CPU prefill's own part with the flash op grouping query heads, against K and V expanded.

``attention/cascade.py`` runs a prefill chunk's own part on torch's CPU flash op. Where the
installed op attends several query heads to one KV head itself (``_flash_takes_gqa``), K and V are
no longer copied to every query head. This probe loads the default model on the CPU, registers a
Prompt Cache schema of ``--modules`` modules of ``--module-tokens`` tokens (``benchmarks/
promptcache_workload.py``), and times, with the op grouping and with K and V expanded in turn, two
requests of one token each: the plain prompt of ten modules and a question (a full prefill,
``cache_salt`` fresh each time) and the PML prompt importing them (the question alone is prefilled
over the cached modules). Median wall of ``--trials`` after an untimed round; the tokens of both
modes compared.

    PYTHONPATH=. python -m benchmarks.probes.cpu_gqa_flash [--trials 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

from benchmarks.harness import run_info
from benchmarks.promptcache_workload import bench_schema, prompts_for

QUESTION = " " + " ".join(["Which", "word", "came", "first", "in", "the", "notes", "above?"] * 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modules", type=int, default=10)
    ap.add_argument("--module-tokens", type=int, default=512)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--json", default=None, help="write the result here")
    args = ap.parse_args()
    if args.trials < 1:
        ap.error("--trials must be at least 1")
    import prefixserve.attention.cascade as cascade
    from prefixserve import LLM, SamplingParams

    if not cascade._flash_takes_gqa():
        raise SystemExit("this torch's CPU flash op does not group query heads: nothing to compare")
    llm = LLM(None, device="cpu", progress=False, module_recompute="none", max_num_batched_tokens=8192)
    tok = llm.get_tokenizer()
    schema, texts = bench_schema(tok, 2 * args.modules, args.module_tokens, 0)
    llm.register_schema(schema)
    pml, plain, _ = prompts_for(random.Random(1), texts, args.modules, QUESTION)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    walls: dict[str, dict[str, list[float]]] = {
        m: {"full": [], "question": []} for m in ("grouped", "expanded")
    }
    tokens: dict[str, list[int]] = {}
    for trial in range(args.trials + 1):
        for mode in walls:
            cascade._flash_takes_gqa = lambda grouped=(mode == "grouped"): grouped  # type: ignore[assignment]
            started = time.perf_counter()
            out = llm.generate({"prompt": plain, "cache_salt": f"{mode}-{trial}"}, one)
            full = time.perf_counter() - started
            started = time.perf_counter()
            llm.generate(pml.replace(QUESTION, f" {mode} {trial}" + QUESTION), one)
            question = time.perf_counter() - started
            tokens.setdefault(mode, list(out[0].outputs[0].token_ids))
            if trial:  # the first round warms up
                walls[mode]["full"].append(full)
                walls[mode]["question"].append(question)
    median = {m: {k: statistics.median(v) * 1e3 for k, v in parts.items()} for m, parts in walls.items()}
    result: dict[str, Any] = {
        "info": run_info(),
        "settings": vars(args),
        "prompt_tokens": len(tok.encode(plain)),
        "median_ms": median,
        "speedup": {k: median["expanded"][k] / median["grouped"][k] for k in ("full", "question")},
        "same_tokens": tokens["grouped"] == tokens["expanded"],
    }
    print(f"{result['prompt_tokens']} prompt tokens, {args.trials} trials, median ms:")
    for mode, parts in median.items():
        print(f"  {mode:9s} full prefill {parts['full']:9.1f}   question {parts['question']:8.1f}")
    print(f"  expanded / grouped: {result['speedup']['full']:.3f}x, {result['speedup']['question']:.3f}x;"
          f" same tokens: {result['same_tokens']}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
