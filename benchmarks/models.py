"""The model families side by side on one GPU (issue 100): decode with a long shared prefix at each
family's shipped shape, against the attainable step measured in the same run.

For each model (dummy weights at real shapes, bf16) and each (B, P): B prompts share one P-token
prefix, each adds --own tokens and decodes --gen (``benchmarks.decode_run.measure``: a warm-up run of
the same shape first). Per model and B, in the same process:
  bare_ms          the decode step's weight matmuls alone at B rows (``benchmarks.dense.bare_step``),
                   graphed, median replay
  attainable       bare_ms + every layer's attention at its T* (KV bytes over the copy rate or FLOPs
                   over the GEMM rate, both measured now): a full layer reads the prefix once and each
                   own part once; a sliding layer reads at most its window of each sequence's tail,
                   the part inside the prefix once and the own part per sequence
  fraction         measured tokens/s over the attainable step's
and the ratios the issue asks for: Qwen3's fraction over Llama's at each (B, P), and Gemma's sharing
on over off; for --keep-models, the same decode keeping every layer's KV (``keep_sliding_kv``), beside
the default that frees the sliding layers' (``kv/layout.py``).

    PYTHONPATH=. python -m benchmarks.models run [--models ...] [--batches 256 1024] [--prefixes 16384]
        [--off-models gemma-3-12b] [--keep-models gemma-3-12b] [--gen 64] [--out docs/benchmarks]
    python -m benchmarks.models report --json docs/benchmarks/models.json
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import RESULTS, pyplot, run_info
from benchmarks.harness.output import run_or_report, write_json, write_text

NAME = "models"


def _config(model: str) -> Any:
    from prefixserve.model.config import ModelConfig
    from prefixserve.model.loader import resolve_model

    return ModelConfig.from_json(resolve_model(model).path)


def attention_ms(cfg: Any, b: int, p: int, s: float, copy_tbps: float, gemm_tflops: float) -> float:
    """Every layer's attention at its T* for B sequences of a P-token shared prefix plus s own tokens."""
    kv_token = 2 * cfg.num_key_value_heads * cfg.head_dim * 2  # K and V, bf16, one layer
    total = 0.0
    for i in range(cfg.num_hidden_layers):
        window = cfg.layer_spec(i).window
        if window is None:
            shared, own, keys = p, b * s, p + s
        else:  # the window's tail of each sequence: its own part, then the prefix's last keys, once
            own_in = min(s, window)
            shared, own, keys = min(p, window - own_in), b * own_in, min(window, p + s)
        bytes_ms = (shared + own) * kv_token / (copy_tbps * 1e12) * 1e3
        flops_ms = 4 * b * cfg.num_attention_heads * cfg.head_dim * keys / (gemm_tflops * 1e12) * 1e3
        total += max(bytes_ms, flops_ms)
    return total


def bare_ms(model: str, batches: list[int]) -> dict[int, float]:
    """The graphed bare matmuls of a decode step at each B, on the model's own weights."""
    from benchmarks.dense import bare_step
    from benchmarks.harness.timing import bench_ms, graphed
    from prefixserve.model.loader import load_model, resolve_model

    net, _ = load_model(resolve_model(model), torch.bfloat16, torch.device("cuda"), progress=False)
    out = {b: bench_ms(graphed(bare_step(net, b, b)), 200) for b in batches}
    del net
    gc.collect()
    torch.cuda.empty_cache()
    return out


def run(args: argparse.Namespace) -> None:
    from benchmarks.decode_run import MODES, measure, shared_prompts
    from benchmarks.harness.timing import measure_ceilings

    device = torch.device("cuda")
    copy_tbps, gemm_tflops = measure_ceilings(device)
    result: dict[str, Any] = {
        **run_info(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("mode", "out")},
        "copy_TBps": copy_tbps,
        "gemm_TFLOPs": gemm_tflops,
        "rows": [],
    }
    out = Path(args.out)
    for name in args.models:
        model = f"dummy:{name}"
        cfg = _config(model)
        bare = bare_ms(model, args.batches)
        modes = ["auto", "sharing_off"] if name in args.off_models else ["auto"]
        if name in args.keep_models:  # the same decode keeping every layer's KV (kv/layout.py)
            modes.append("keep_sliding_kv")
        for b in args.batches:
            for p in args.prefixes:
                prompts = (shared_prompts(b, p, args.own, seed=0), shared_prompts(b, p, args.own, seed=1))
                s = args.own + args.gen / 2
                attainable_ms = bare[b] + attention_ms(cfg, b, p, s, copy_tbps, gemm_tflops)
                row: dict[str, Any] = {"model": name, "B": b, "P": p, "bare_ms": bare[b]}
                row["attainable_tok_s"] = b / attainable_ms * 1e3
                for mode in modes:
                    keep = {"keep_sliding_kv": True} if mode == "keep_sliding_kv" else {}
                    attention = MODES.get(mode, "auto")
                    batched = args.max_batched
                    got = measure(model, "cuda", attention, prompts, args.gen, max_batched=batched, **keep)
                    row[f"{mode}_tok_s"] = got["tok_s"]
                    row[f"{mode}_host_overhead"] = got["host_overhead_frac"]
                    row[f"{mode}_kv_read_saving_x"] = got["kv_read_saving_x"]
                    row[f"{mode}_preemptions"] = got["preemptions"]
                row["fraction"] = row["auto_tok_s"] / row["attainable_tok_s"]
                if "sharing_off_tok_s" in row:
                    row["on_over_off"] = row["auto_tok_s"] / row["sharing_off_tok_s"]
                if "keep_sliding_kv_tok_s" in row:
                    row["free_over_keep"] = row["auto_tok_s"] / row["keep_sliding_kv_tok_s"]
                result["rows"].append(row)
                write_json(out / f"{NAME}.json", result)  # a cut-short run keeps what it measured
                print(row, flush=True)
    report(result, out)


def _ratios(rows: list[dict]) -> list[dict]:
    """Qwen3-8B's fraction of the attainable step over Llama-3.1-8B's at each (B, P)."""
    by = {(r["model"], r["B"], r["P"]): r for r in rows}
    out = []
    for (model, b, p), r in by.items():
        llama = by.get(("llama-3.1-8b", b, p))
        if model.startswith("qwen3") and llama is not None:
            out.append({"B": b, "P": p, "ratio": r["fraction"] / llama["fraction"]})
    return out


def report(result: dict[str, Any], out: Path) -> None:
    rows = result["rows"]
    lines = [
        "# Model families: decode with a shared prefix against the attainable step",
        "",
        f"{result['device']}; torch {result['torch']}; commit {result['commit']}; {result['date']}; "
        f"dummy weights, bf16; own {result['settings']['own']} tokens per prompt, "
        f"{result['settings']['gen']} generated. Ceilings measured in this run: copy "
        f"{result['copy_TBps']:.2f} TB/s, GEMM {result['gemm_TFLOPs']:.0f} TFLOP/s. "
        "Written by `benchmarks/models.py`.",
        "",
        "| model | B | P | bare matmuls ms | sharing on tok/s | sharing off tok/s | on / off "
        "| attainable tok/s | fraction of attainable | host overhead (on) | every layer's KV kept tok/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        off = r.get("sharing_off_tok_s")
        off_cells = "| | |" if off is None else f"| {off:,.0f} | {r['on_over_off']:.2f}x |"
        lines.append(
            f"| {r['model']} | {r['B']} | {r['P']} | {r['bare_ms']:.2f} | {r['auto_tok_s']:,.0f} {off_cells} "
            f"{r['attainable_tok_s']:,.0f} | {r['fraction']:.3f} | {r['auto_host_overhead']:.3f} | "
            + (f"{r['keep_sliding_kv_tok_s']:,.0f} |" if "keep_sliding_kv_tok_s" in r else " |")
        )
    ratios = _ratios(rows)
    if ratios:
        lines += [
            "",
            "Qwen3-8B's fraction of the attainable step over Llama-3.1-8B's (target: within 3%):",
            "",
        ]
        lines += [f"- B={q['B']}, P={q['P']}: {q['ratio']:.3f}" for q in ratios]
    result["qwen3_over_llama"] = ratios
    write_json(out / f"{NAME}.json", result)
    write_text(out, f"{NAME}.md", lines)
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{r['model']}\nB={r['B']} P={r['P'] // 1024}K" for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.27 for i in x], [r["auto_tok_s"] for r in rows], width=0.27, label="sharing on")
    off = [r.get("sharing_off_tok_s", 0.0) for r in rows]
    if any(off):
        ax.bar(list(x), off, width=0.27, label="sharing off")
    attainable = [r["attainable_tok_s"] for r in rows]
    ax.bar([i + 0.27 for i in x], attainable, width=0.27, label="attainable", alpha=0.5)
    ax.set_xticks(list(x), labels, fontsize=6)
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"Model families on {result['device']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / f"{NAME}.png", dpi=120)


def add_run_args(r: argparse.ArgumentParser) -> None:
    r.add_argument("--models", nargs="+", default=["llama-3.1-8b", "qwen3-8b", "gemma-3-12b"])
    r.add_argument(
        "--off-models", nargs="*", default=["gemma-3-12b"], help="models also run with sharing off"
    )
    r.add_argument(
        "--keep-models", nargs="*", default=["gemma-3-12b"], help="models also run keeping every layer's KV"
    )
    r.add_argument("--batches", type=int, nargs="+", default=[256, 1024])
    r.add_argument("--prefixes", type=int, nargs="+", default=[16384])
    r.add_argument("--own", type=int, default=64)
    r.add_argument("--gen", type=int, default=64)
    r.add_argument("--max-batched", type=int, default=16384)


if __name__ == "__main__":
    run_or_report(__doc__, NAME, RESULTS, add_run_args, run, report)
