"""Decode throughput with a shared prefix (Hydragen Fig. 3/4): sharing on vs off vs the no-attention ceiling.

All B requests share one P-token prefix, each adds 64 unique prompt tokens and generates 128 tokens
(EOS ignored). Decode-only throughput excludes the prefill (Hydragen appendix E.1); prefill time is
reported apart. Modes: ``auto`` (shared-segment attention), ``sharing_off`` (the plain paged kernel;
shared blocks are still stored once, as vLLM does) and ``ceiling`` (attention skipped).

    python -m benchmarks.throughput                   # the issue's grid, Llama-3.1-8B shapes, bf16, GPU
    python -m benchmarks.throughput --model dummy:PATH --batches 4 --prefixes 64 --device cpu  # smoke
"""

from __future__ import annotations

import argparse
import gc
import random
import time

import torch

from benchmarks._common import RESULTS, run_info, write_results
from prefixserve import LLM, SamplingParams

MODES = {"auto": "auto", "sharing_off": "triton_paged", "ceiling": "none"}


def _prompts(batch: int, prefix: int, own: int, seed: int = 0) -> list[dict]:
    """``batch`` prompts: one shared ``prefix``-token run, then ``own`` tokens unique to each."""
    rng = random.Random(seed)
    shared = [rng.randrange(1000, 30000) for _ in range(prefix)]
    return [
        {"prompt_token_ids": shared + [rng.randrange(1000, 30000) for _ in range(own)]} for _ in range(batch)
    ]


def measure(model: str, device: str, attention: str, prompts: list[dict], gen: int, n: int = 1) -> dict:
    llm = LLM(
        model=model,
        dtype="bfloat16" if device == "cuda" else "float32",
        device=device,
        attention=attention,
        max_num_seqs=len(prompts) * n,
        max_num_batched_tokens=16384,
        progress=False,
    )
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up: kernels compile
    before = llm.metrics()
    params = SamplingParams(n=n, temperature=0.0 if n == 1 else 1.0, seed=0, max_tokens=gen, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    after = llm.metrics()
    first = max(o.metrics["first_token_time"] for o in outs)
    last = max(o.metrics["finish_time"] for o in outs)
    decode_tokens = sum(len(c.token_ids) - 1 for o in outs for c in o.outputs)
    steps = after["step_seconds_total"] - before["step_seconds_total"]
    host = after["step_host_seconds_total"] - before["step_host_seconds_total"]
    result = {
        "tok_s": decode_tokens / max(last - first, 1e-9),
        "prefill_s": first - t0,
        "elapsed_s": elapsed,
        "host_overhead_frac": host / max(steps, 1e-9),
        "kv_read_saving_x": (
            after["attention_kv_tokens_logical_total"] - before["attention_kv_tokens_logical_total"]
        )
        / max(1, after["attention_kv_tokens_read_total"] - before["attention_kv_tokens_read_total"]),
    }
    del llm, outs
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def plot(payload: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for b in sorted({r["B"] for r in payload["rows"]}):
        rows = sorted((r for r in payload["rows"] if r["B"] == b), key=lambda r: r["P"])
        ps = [r["P"] for r in rows]
        line = ax.plot(ps, [r["auto_tok_s"] for r in rows], marker="o", label=f"B={b} sharing on")[0]
        ax.plot(
            ps,
            [r["sharing_off_tok_s"] for r in rows],
            marker="x",
            color=line.get_color(),
            alpha=0.6,
            label=f"B={b} sharing off",
        )
        ax.plot(ps, [r["ceiling_tok_s"] for r in rows], linestyle="--", color=line.get_color(), alpha=0.6)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("shared prefix length P (tokens)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"{payload['model']} on {payload['device']} (dashed: no-attention ceiling)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / "throughput.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--prefixes", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--own", type=int, default=64)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--modes", nargs="+", default=list(MODES))
    ap.add_argument("--no-n8", action="store_true")
    args = ap.parse_args()
    modes = {k: MODES[k] for k in args.modes}
    if args.device != "cuda":
        modes = {k: ("reference" if v == "triton_paged" else v) for k, v in modes.items()}
    rows = []
    for b in args.batches:
        for p in args.prefixes:
            prompts = _prompts(b, p, args.own)
            row: dict = {"B": b, "P": p}
            for mode, attention in modes.items():
                r = measure(args.model, args.device, attention, prompts, args.gen)
                row[f"{mode}_tok_s"] = r["tok_s"]
                row[f"{mode}_prefill_s"] = r["prefill_s"]
                if mode == "auto":
                    row["host_overhead_frac"] = r["host_overhead_frac"]
                    row["kv_read_saving_x"] = r["kv_read_saving_x"]
            print(row, flush=True)
            rows.append(row)
            report(args, rows, None)
    n8 = None
    if not args.no_n8:
        prompts = _prompts(32, 4096 if args.device == "cuda" else args.prefixes[0], args.own)
        n8 = {
            mode: measure(args.model, args.device, attention, prompts, args.gen, n=8)
            for mode, attention in modes.items()
        }
    report(args, rows, n8)


def report(args: argparse.Namespace, rows: list[dict], n8: dict | None) -> None:
    """Write JSON + Markdown (+ plot); called after every row, so a cut-short run keeps what it measured."""
    payload = {**run_info(), "model": args.model, "gen": args.gen, "own": args.own, "rows": rows, "n8": n8}
    md = [
        "# Decode throughput with a shared prefix",
        "",
        f"{payload['device']}; torch {payload['torch']}; commit {payload['commit']}; {payload['date']}; "
        f"model {args.model}; own {args.own} tokens, {args.gen} generated; eager (no CUDA graphs yet). "
        "Written by `benchmarks/throughput.py`.",
        "",
        "| B | P | sharing on tok/s | sharing off tok/s | ceiling tok/s | on/off | on/ceiling "
        "| host overhead |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        on, off, ceil = r.get("auto_tok_s", 0), r.get("sharing_off_tok_s", 0), r.get("ceiling_tok_s", 0)
        md.append(
            f"| {r['B']} | {r['P']} | {on:.0f} | {off:.0f} | {ceil:.0f} | {on / max(off, 1e-9):.2f}x | "
            f"{on / max(ceil, 1e-9):.0%} | {r.get('host_overhead_frac', 0):.0%} |"
        )
    if n8:
        md += [
            "",
            "n=8 samples x 32 prompts (two-level sharing): "
            + ", ".join(f"{m} {r['tok_s']:.0f} tok/s" for m, r in n8.items()),
        ]
    write_results("throughput", payload, "\n".join(md) + "\n")
    plot(payload)


if __name__ == "__main__":
    main()
