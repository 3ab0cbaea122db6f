"""Beam search over shared prompts: what the prefix cache saves it, and its cost against sampling.

Q questions on one D-token document (prompts: the document, then a short question) run three ways,
each generating W outputs of T tokens per question (``ignore_eos``):

* ``beam_search``: ``LLM.beam_search`` with width W; each step runs every live beam as a one-token
  request whose prompt (document, question, the beam's tokens) comes from the prefix cache but for
  its tail since its last full block;
* ``beam_search_no_cache``: the same search on an engine without the prefix cache (every step
  recomputes every beam's whole prompt): the saving's measure;
* ``sampled``: ``generate`` with ``n=W``, temperature 1 (W samples decoded together): the cost of W
  outputs without a search.

Reported: seconds, generated tokens/s (W x T x Q over the run), the steps' prompt tokens and the
share served from the prefix cache, and whether the two searches found the same beams.

    python -m benchmarks.beam_search [--device cpu|cuda] [--model dummy:llama-3.1-8b] [--doc 2000]
        [--questions 4] [--width 4] [--tokens 32]

Writes docs/benchmarks/beam_search_{cpu,gpu}.{json,md,png}.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from benchmarks.harness import RESULTS, bar_chart, run_info, write_results
from prefixserve import LLM, SamplingParams
from prefixserve.sampling.beam_search import BeamSearchParams

COUNTED = ("prompt_tokens_total", "prefix_cache_hit_tokens_total", "generation_tokens_total")


def _prompts(args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(0)
    document = [rng.randrange(100, 20000) for _ in range(args.doc)]
    return [
        {"prompt_token_ids": document + [rng.randrange(100, 20000) for _ in range(12)]}
        for _ in range(args.questions)
    ]


def _engine(args: argparse.Namespace, dtype: str, cache: bool) -> LLM:
    return LLM(model=args.model, dtype=dtype, device=args.device, enable_prefix_caching=cache, progress=False)


def _timed(llm: LLM, run: Any) -> tuple[float, Any, dict[str, float]]:
    before = llm.metrics()
    t0 = time.perf_counter()
    out = run()
    seconds = time.perf_counter() - t0
    after = llm.metrics()
    return seconds, out, {k: after.get(k, 0.0) - before.get(k, 0.0) for k in COUNTED}


def _release(device: str) -> None:
    """The engine's memory back to the device, so the next engine sizes its KV pool as the first."""
    import gc

    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    prompts = _prompts(args)
    search = BeamSearchParams(beam_width=args.width, max_tokens=args.tokens, ignore_eos=True)
    sampled = SamplingParams(n=args.width, max_tokens=args.tokens, temperature=1.0, seed=0, ignore_eos=True)
    results: dict[str, dict[str, float]] = {}
    beams: dict[str, list[list[list[int]]]] = {}
    for name, cache in (("beam_search", True), ("beam_search_no_cache", False)):
        llm = _engine(args, dtype, cache)
        llm.beam_search(prompts, search)  # untimed: the steps' graph shapes captured, kernels compiled
        if cache:
            llm.generate(prompts, sampled)
        llm.reset_prefix_cache()  # the timed runs start from an empty prefix cache
        seconds, outs, counts = _timed(llm, lambda llm=llm: llm.beam_search(prompts, search))
        beams[name] = [[s.tokens for s in o.sequences] for o in outs]
        results[name] = {"seconds": seconds, **counts}
        if cache:
            llm.reset_prefix_cache()
            seconds, _, counts = _timed(llm, lambda llm=llm: llm.generate(prompts, sampled))
            results["sampled"] = {"seconds": seconds, **counts}
        llm.shutdown()
        del llm
        _release(args.device)
    generated = args.questions * args.width * args.tokens
    for row in results.values():
        row["tokens_per_s"] = generated / row["seconds"]
        prompt = row["prompt_tokens_total"]
        row["cache_hit_share"] = row["prefix_cache_hit_tokens_total"] / prompt if prompt else 0.0
        print(row)
    return {
        "info": run_info(("transformers",)),
        "settings": vars(args) | {"dtype": dtype},
        "generated_tokens": generated,
        "results": results,
        "cache_speedup": results["beam_search_no_cache"]["seconds"] / results["beam_search"]["seconds"],
        "over_sampled": results["beam_search"]["seconds"] / results["sampled"]["seconds"],
        "same_beams": beams["beam_search"] == beams["beam_search_no_cache"],
    }


def markdown(result: dict[str, Any], name: str) -> str:
    s, info, r = result["settings"], result["info"], result["results"]
    lines = [
        f"# Beam search over shared prompts ({s['device']})",
        "",
        f"`python -m benchmarks.beam_search --device {s['device']}"
        + (f" --model {s['model']}" if s["model"] else "")
        + f" --doc {s['doc']} --questions {s['questions']} --width {s['width']} --tokens {s['tokens']}`: "
        f"{s['questions']} questions on one {s['doc']}-token document, {s['width']} outputs of {s['tokens']} "
        f"tokens each, {s['model'] or 'the default model'} in {s['dtype']}; each mode runs once after a "
        "warm-up run of the same work (graphs captured, kernels compiled), from an empty prefix cache.",
        "",
        "| mode | seconds | generated tok/s | steps' prompt tokens | from the prefix cache |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for mode, row in r.items():
        lines.append(
            f"| {mode} | {row['seconds']:.2f} | {row['tokens_per_s']:.0f} | "
            f"{row['prompt_tokens_total']:.0f} | {row['cache_hit_share']:.1%} |"
        )
    lines += [
        "",
        f"The prefix cache makes the search **{result['cache_speedup']:.2f}x** faster; the search costs "
        f"**{result['over_sampled']:.2f}x** the time of sampling the same outputs. The two searches found "
        f"{'the same' if result['same_beams'] else 'different'} beams.",
        "",
        f"Device: {info['device']} ({info['cpu_count']} CPUs); torch {info['torch']}, "
        f"commit {info['commit']}, {info['date']}.",
        "",
        f"![seconds]({name}.png)",
    ]
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Any) -> None:
    s = result["settings"]
    title = f"{s['questions']} x {s['doc']}-token prompts, width {s['width']}, {s['device']}"
    bar_chart(path, result["results"], "seconds", "seconds", title, ["#3b7dd8", "#888888", "#7fb3f0"])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--doc", type=int, default=2000)
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument(
        "--name", default=None, help="result file name (default beam_search_cpu / beam_search_gpu)"
    )
    args = ap.parse_args(argv)
    name = args.name or ("beam_search_cpu" if args.device == "cpu" else "beam_search_gpu")
    result = measure(args)
    write_results(name, result, markdown(result, name))
    plot(result, RESULTS / f"{name}.png")


if __name__ == "__main__":
    main()
