"""Decode throughput with a shared prefix (Hydragen Fig. 3/4): sharing on vs off vs the no-attention ceiling.

All B requests share one P-token prefix, each adds 64 unique prompt tokens and generates 128 tokens
(EOS ignored). Decode-only throughput excludes the prefill (Hydragen appendix E.1); prefill time is
reported apart. Modes: ``auto`` (shared-segment attention), ``sharing_off`` (the plain paged kernel;
shared blocks are still stored once, as vLLM does) and ``ceiling`` (attention skipped).

    python -m benchmarks.throughput                   # the issue's grid, Llama-3.1-8B shapes, bf16, GPU
    python -m benchmarks.throughput --model dummy:PATH --batches 4 --prefixes 64 --device cpu  # smoke
    python -m benchmarks.throughput --mixed           # long own parts: mixed kernel vs two kernels
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from benchmarks.decode_run import MODES, measure, shared_prompts
from benchmarks.harness import RESULTS, pyplot, run_info, write_results


def plot(payload: dict, out: Path = RESULTS) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for b in sorted({r["B"] for r in payload["rows"]}):
        rows = sorted((r for r in payload["rows"] if r["B"] == b), key=lambda r: r["P"])
        ps = [r["P"] for r in rows]
        line = ax.plot(ps, [r["auto_tok_s"] for r in rows], marker="o", label=f"B={b} sharing on")[0]
        if all("sharing_off_tok_s" in r for r in rows):  # a run of some modes plots only those
            off = [r["sharing_off_tok_s"] for r in rows]
            ax.plot(ps, off, marker="x", color=line.get_color(), alpha=0.6, label=f"B={b} sharing off")
        if all("ceiling_tok_s" in r for r in rows):
            ceiling = [r["ceiling_tok_s"] for r in rows]
            ax.plot(ps, ceiling, linestyle="--", color=line.get_color(), alpha=0.6)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("shared prefix length P (tokens)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"{payload['model']} on {payload['device']} (dashed: no-attention ceiling)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=120)


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
    ap.add_argument(
        "--out",
        type=Path,
        default=RESULTS,
        help="where the results go (the grid's throughput.{json,md,png}, --mixed's throughput_mixed*, "
        "--tensor-parallel-size's tensor_parallel.*), and the dense.json the attainable step is read from",
    )
    ap.add_argument(
        "--merge",
        action="store_true",
        help="keep rows (and n8) of the existing throughput.json for other (B, P)",
    )
    ap.add_argument(
        "--enforce-eager", action="store_true", help="no CUDA graphs (the engine's default uses them)"
    )
    ap.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="> 1: the tensor-parallel runs of benchmarks/tensor_parallel.py (its own options follow)",
    )
    ap.add_argument(
        "--mixed",
        action="store_true",
        help="decode with long own parts, the mixed kernel (mixed_gluon.py) vs the two kernels: "
        "throughput_mixed.{json,md}",
    )
    ap.add_argument(
        "--report",
        action="store_true",
        help="measure nothing: rewrite --out's throughput.{md,png} from its throughput.json and dense.json",
    )
    args, rest = ap.parse_known_args()
    if args.report:
        saved = json.loads((args.out / "throughput.json").read_text())
        args.model, args.own, args.gen = saved["model"], saved["own"], saved["gen"]
        args.enforce_eager = not saved["cuda_graphs"]
        run_keys = ("model", "gen", "own", "cuda_graphs", "rows", "n8")
        info = {k: v for k, v in saved.items() if k not in run_keys}
        report(args, saved["rows"], saved["n8"], info)
        return
    if args.tensor_parallel_size > 1:
        from benchmarks import tensor_parallel

        tensor_parallel.main(
            ["--tensor-parallel-size", str(args.tensor_parallel_size), "--out", str(args.out), *rest]
        )
        return
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.mixed:
        mixed_grid(args)
        return
    modes = {k: MODES[k] for k in args.modes}
    if args.device != "cuda":
        modes = {k: ("reference" if v == "triton_paged" else v) for k, v in modes.items()}
    rows, kept_n8 = [], None
    if args.merge and (args.out / "throughput.json").exists():  # a grid too long for one run, in parts
        old = json.loads((args.out / "throughput.json").read_text())
        todo = {(b, p) for b in args.batches for p in args.prefixes}
        rows = [r for r in old["rows"] if (r["B"], r["P"]) not in todo]
        kept_n8 = old.get("n8")
    for b in args.batches:
        for p in args.prefixes:
            prompts = (shared_prompts(b, p, args.own), shared_prompts(b, p, args.own, seed=1))
            row: dict = {"B": b, "P": p}
            for mode, attention in modes.items():
                if args.device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                r = measure(args.model, args.device, attention, prompts, args.gen, eager=args.enforce_eager)
                row[f"{mode}_tok_s"] = r["tok_s"]
                row[f"{mode}_prefill_s"] = r["prefill_s"]
                row[f"{mode}_host_overhead_frac"] = r["host_overhead_frac"]
                row[f"{mode}_gc_pause_s"] = r["gc_pause_s"]
                if mode == "auto":
                    row["host_overhead_frac"] = r["host_overhead_frac"]
                    row["host_ms_per_step"] = r["host_ms_per_step"]
                    row["kv_read_saving_x"] = r["kv_read_saving_x"]
                    row["memory_needed_gb"] = r.get("memory_needed_gb")
                    row["graphs_captured"] = r["graphs_captured"]
                    row["graphs_tma"] = f"{r['graphs_tma']}/{r['graphs_shared']}"
            print(row, flush=True)
            rows.append(row)
            rows.sort(key=lambda r: (r["B"], r["P"]))
            report(args, rows, kept_n8)
    n8 = kept_n8
    if not args.no_n8:
        p = 4096 if args.device == "cuda" else args.prefixes[0]
        prompts = (shared_prompts(32, p, args.own), shared_prompts(32, p, args.own, seed=1))
        n8 = {
            mode: measure(
                args.model, args.device, attention, prompts, args.gen, n=8, eager=args.enforce_eager
            )
            for mode, attention in modes.items()
        }
    report(args, rows, n8)


def attainable_tok_s(b: int, p: int, own: int, gen: int, dense: dict, model: str) -> float | None:
    """Tokens/s of the attainable decode step (docs/kernels.md §5): the step's bare graphed matmuls at B
    (``dense.json``, same GPU kind) plus every layer's attention at its T*, the larger of its KV bytes
    over the copy bandwidth and its FLOPs over the GEMM rate (both measured in dense.json's run), at
    the mean own length of the decode (own + gen / 2): the prefix read once, each own part once."""
    from prefixserve.model.config import ModelConfig
    from prefixserve.model.loader import resolve_model

    bare = {r["B"]: r["bare_ms"] for r in dense.get("rows", [])}
    if b not in bare:
        return None
    cfg = ModelConfig.from_json(resolve_model(model).path) if model.startswith("dummy") else None
    if cfg is None:
        return None
    s = own + gen / 2
    kv_bytes = 2 * cfg.num_key_value_heads * cfg.head_dim * 2  # K and V, bf16, one layer, one token
    bytes_ms = (p + b * s) * kv_bytes / (dense["copy_bandwidth_TBps"] * 1e12) * 1e3
    flops = 4 * b * cfg.num_attention_heads * cfg.head_dim * (p + s)  # QK^T and PV, one layer
    flops_ms = flops / (dense["gemm_TFLOPs"] * 1e12) * 1e3
    step_ms = bare[b] + cfg.num_hidden_layers * max(bytes_ms, flops_ms)
    return b / step_ms * 1e3


def report(args: argparse.Namespace, rows: list[dict], n8: dict | None, info: dict | None = None) -> None:
    """Write JSON + Markdown (+ plot); called after every row, so a cut-short run keeps what it measured.
    ``info``: the run's device, versions, date and commit (``--report``: those of the saved run)."""
    graphs = "eager (--enforce-eager)" if args.enforce_eager else "decode under CUDA graphs"
    payload = {
        **(info or run_info()),
        "model": args.model,
        "gen": args.gen,
        "own": args.own,
        "cuda_graphs": not args.enforce_eager,
        "rows": rows,
        "n8": n8,
    }
    md = [
        "# Decode throughput with a shared prefix",
        "",
        f"{payload['device']}; torch {payload['torch']}; commit {payload['commit']}; {payload['date']}; "
        f"model {args.model}; own {args.own} tokens, {args.gen} generated; {graphs}. "
        "Decode-only tokens/s (first token to last finish). Host overhead: the share of the GPU's time "
        "spent idle between consecutive decode steps, waiting for the host (CUDA events). "
        "Memory needed: all the run allocated, with the KV pool counted at its peak use, not its size. "
        "Written by `benchmarks/throughput.py`.",
        "",
        "| B | P | sharing on tok/s | sharing off tok/s | ceiling tok/s | on/off | on/ceiling "
        "| fraction of the attainable step | host overhead | memory needed |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    dense_path = args.out / "dense.json"
    dense = json.loads(dense_path.read_text()) if dense_path.exists() else {}
    if dense and dense.get("device") != payload["device"]:
        dense = {}  # the attainable step is only meaningful on the GPU kind it was measured on
    for r in rows:
        on, off, ceil = r.get("auto_tok_s", 0), r.get("sharing_off_tok_s", 0), r.get("ceiling_tok_s", 0)
        best = attainable_tok_s(r["B"], r["P"], args.own, args.gen, dense, args.model) if dense else None
        if best:
            r["attainable_tok_s"] = best
        frac = f"{on / best:.3f}" if best else "-"  # three places: 0.7985 is short of 0.8, not "80%"
        md.append(
            f"| {r['B']} | {r['P']} | {on:.0f} | {off:.0f} | {ceil:.0f} | {on / max(off, 1e-9):.2f}x | "
            f"{on / max(ceil, 1e-9):.0%} | {frac} | {r.get('host_overhead_frac', 0):.0%} | "
            f"{r.get('memory_needed_gb') or 0:.1f} GB |"
        )
    if dense:
        md += [
            "",
            "Attainable step: the step's bare graphed matmuls (`dense.json`, commit "
            f"{dense.get('commit')}) plus each layer's attention at T* = max(KV bytes / "
            f"{dense['copy_bandwidth_TBps']:.2f} TB/s, FLOPs / {dense['gemm_TFLOPs']:.0f} TFLOP/s), "
            "own parts at their mean length over the decode; tokens/s = B / that step.",
        ]
    if n8:
        md += [
            "",
            "n=8 samples x 32 prompts (two-level sharing): "
            + ", ".join(f"{m} {r['tok_s']:.0f} tok/s" for m, r in n8.items()),
        ]
    write_results("throughput", payload, "\n".join(md) + "\n", args.out)
    plot(payload, args.out)


def mixed_grid(args: argparse.Namespace) -> None:
    """Sharing on, with the mixed kernel on every eligible decode step vs never (two kernels per layer).

    Own prompt parts of ``--own`` tokens (default here 512: two or more own tiles per sequence, where
    the rule can take the mixed kernel), so the own KV outweighs the shared prefix's products. The
    mixed kernel's own tile height is ``own_rows_for``'s (128 rows where own parts stay short and the
    prefix is under 64 times them).
    """
    from prefixserve.attention.planning import mixed_rule

    own = args.own if args.own != 64 else 512
    points = [(b, p) for b in args.batches for p in args.prefixes]
    if points == [(b, p) for b in (64, 256, 1024) for p in (1024, 4096, 16384)]:  # the defaults
        points = [(256, 1024), (256, 4096), (1024, 1024), (1024, 4096)]
    rows = []
    # own parts short to the end of the run: the rule takes 128-row own tiles
    short = own + args.gen <= mixed_rule.SHORT_OWN_TOKENS
    # the 8B shapes (GQA 4); per sequence, a shared part of P tokens against ``own``
    short = short and all(mixed_rule.own_rows_for(own, 1, 4, p) != mixed_rule.OWN_M for _, p in points)
    variants = [("mixed", "1"), ("two_kernels", "0")]
    keep = os.environ.get("PREFIXSERVE_MIXED")
    for b, p in points:
        prompts = (shared_prompts(b, p, own), shared_prompts(b, p, own, seed=1))
        row: dict = {"B": b, "P": p}
        for name, mode in variants:
            os.environ["PREFIXSERVE_MIXED"] = mode  # read by prefixserve.config.mixed_mode() per step
            try:
                r = measure(args.model, args.device, "auto", prompts, args.gen)
            finally:
                if keep is None:
                    os.environ.pop("PREFIXSERVE_MIXED", None)
                else:
                    os.environ["PREFIXSERVE_MIXED"] = keep
            row[f"{name}_tok_s"] = r["tok_s"]
            row[f"{name}_graphs_mixed"] = r["graphs_mixed"]
            row[f"{name}_captures"] = r["graphs_captured"]
        print(row, flush=True)
        rows.append(row)
        payload = {**run_info(), "model": args.model, "gen": args.gen, "own": own, "rows": rows}
        md = [
            "# Decode throughput: the mixed kernel vs two kernels per layer",
            "",
            f"{payload['device']}; torch {payload['torch']}; commit {payload['commit']}; {payload['date']}; "
            f"model {args.model}; {own} own prompt tokens per sequence, {args.gen} generated; decode under "
            "CUDA graphs; sharing on (`auto`). `mixed`: PREFIXSERVE_MIXED=1 (every eligible decode step "
            "on the mixed kernel); `two kernels`: PREFIXSERVE_MIXED=0 (shared kernel + own kernel). "
            "`graphs` = captured decode graphs on the mixed kernel / all captures (mixed run), "
            "`captures` = the two-kernel run's. Written by "
            "`benchmarks/throughput.py --mixed`."
            + (
                " Own parts stay short (mean under 256 tokens), so the mixed kernel runs 128-row own "
                "tiles (`own_rows_for`)."
                if short
                else ""
            ),
            "",
            "| B | P | mixed tok/s | two kernels tok/s | mixed / two | graphs | captures |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for x in rows:
            ratio = x["mixed_tok_s"] / max(x["two_kernels_tok_s"], 1e-9)
            md.append(
                f"| {x['B']} | {x['P']} | {x['mixed_tok_s']:.0f} | {x['two_kernels_tok_s']:.0f} | "
                f"{ratio:.3f}x | {x['mixed_graphs_mixed']}/{x['mixed_captures']} | "
                f"{x['two_kernels_captures']} |"
            )
        name = f"throughput_mixed{'_own' + str(own) if short else ''}"
        write_results(name, payload, "\n".join(md) + "\n", args.out)


if __name__ == "__main__":
    main()
