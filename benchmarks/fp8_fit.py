"""The 70B shape on one GPU with FP8 weights (issue 103): it loads, serves, and decodes a grid.

Parts (``--parts``; dummy weights, bf16 activations, FP8 projections as ``--quantization fp8`` makes them):
  grid   B in ``--batches`` x P in ``--prefixes``: B requests behind one P-token shared prefix, ``--own``
         tokens each, ``--gen`` generated; decode tokens/s with sharing on (attention ``auto``) and off
         (the plain paged kernel, each row reading the prefix), under CUDA graphs. One engine per mode
         serves the whole grid (a 70B engine loads in tens of seconds): each point is a warm-up run of
         its shape, then the timed run, prompts of their own (``benchmarks.decode_run.timed_decode``).
         Each engine's load seconds, weight GiB and KV pool go beside it.
  serve  ``prefixserve serve --quantization fp8`` of the model: start seconds, then a burst of
         ``--serve-batch`` concurrent completions (an untimed one first), tokens/s.

``--kv-cache-dtype fp8`` runs the grid over an FP8 KV cache as well.

Usage (GPU; about 6 minutes on an H200 at the defaults):
  PYTHONPATH=. python -m benchmarks.fp8_fit run [--out DIR] [--model dummy:llama-3.1-70b]
      [--batches 64 256] [--prefixes 1024 16384] [--parts grid serve] [--kv-cache-dtype fp8]
  PYTHONPATH=. python -m benchmarks.fp8_fit run --smoke    # CPU, a tiny model, seconds (to a temp dir)
  python -m benchmarks.fp8_fit report --json FILE [--out DIR]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import RESULTS, TINY, dummy_model, pyplot, run_info, run_or_report, write_text
from benchmarks.harness.models import bf16_weights_GiB
from benchmarks.harness.output import write_json

NAME = "fp8_fit"
SHARING = {"on": "auto", "off": "triton_paged"}  # grid mode -> the engine's attention
SMOKE_OFF = "reference"  # sharing off on the CPU: the Triton kernel runs only on a GPU or the interpreter


def grid_modes(kv_cache_dtype: str | None) -> dict[str, dict[str, Any]]:
    """Each grid engine's EngineConfig fields beside FP8 weights: the model's KV dtype, and
    ``kv_cache_dtype``'s where given."""
    out: dict[str, dict[str, Any]] = {"fp8": {"quantization": "fp8"}}
    if kv_cache_dtype is not None:
        out[f"fp8+kv-{kv_cache_dtype}"] = {"quantization": "fp8", "kv_cache_dtype": kv_cache_dtype}
    return out


def grid_part(
    args: argparse.Namespace,
    weights: str,
    fields: dict[str, Any],
    out: dict[str, Any],
    save: Callable[[], None],
) -> None:
    """Every (B, P) point with sharing on and off, one engine a sharing mode, into ``out`` (saved after
    each point: a run cut short keeps what it measured)."""
    from benchmarks.decode_run import decode_engine, shared_prompts, timed_decode
    from benchmarks.dense import _collect
    from prefixserve.model.memory_fit import GiB, weight_bytes

    device = "cpu" if args.smoke else "cuda"
    points = [(b, p) for p in args.prefixes for b in args.batches]
    out |= {"weights": weights, "fields": fields, "engines": {}, "points": []}
    rows: dict[tuple[int, int], dict[str, Any]] = {}
    for sharing, attention in SHARING.items():
        attention = SMOKE_OFF if args.smoke and sharing == "off" else attention
        t0 = time.perf_counter()
        llm = decode_engine(args.model, device, attention, max(args.batches), **fields, **_pool(args))
        out["engines"][sharing] = {
            "load_s": time.perf_counter() - t0,
            "weights_GiB": weight_bytes(llm.engine.runner.model) / GiB,
            "kv_blocks": llm.engine.runner.num_blocks,
        }
        for i, (b, p) in enumerate(points):
            prompts = (
                shared_prompts(b, p, args.own, seed=2 * i),
                shared_prompts(b, p, args.own, seed=2 * i + 1),
            )
            got = timed_decode(llm, device, prompts, args.gen)
            row = rows.get((b, p))
            if row is None:
                row = rows[(b, p)] = {"B": b, "P": p}
                out["points"].append(row)
            row[sharing] = {
                k: got[k]
                for k in (
                    "tok_s",
                    "kv_blocks_used_peak",
                    "preemptions",
                    "prefill_s",
                    "steps",
                    "kv_read_saving_x",
                )
            }
            row[sharing]["step_ms"] = 1e3 * b / got["tok_s"]
            if "on" in row and "off" in row:
                row["on_over_off"] = row["on"]["tok_s"] / row["off"]["tok_s"]
            print(weights, sharing, b, p, row[sharing], flush=True)
            save()
        llm.shutdown()
        del llm
        _collect()


def _pool(args: argparse.Namespace) -> dict[str, Any]:
    """The KV pool's size: a smoke run's small fixed one (the CPU's memory is the host's), else sized
    from the free memory."""
    return {"num_kv_blocks": 512} if args.smoke else {}


def run(args: argparse.Namespace) -> None:
    if args.smoke:
        args.batches, args.prefixes, args.own, args.gen = [2, 4], [16, 64], 8, 4
        if args.out == str(RESULTS):  # a smoke run never overwrites the GPU results
            args.out = tempfile.mkdtemp(prefix="fp8-fit-smoke-")
        args.model = dummy_model(TINY, Path(args.out) / "tiny")
    elif not torch.cuda.is_available():
        raise SystemExit("benchmarks/fp8_fit.py needs a CUDA GPU (or --smoke)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    result: dict[str, Any] = {
        **run_info(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("mode", "out")},
        "bf16_weights_GiB": bf16_weights_GiB(args.model),
        "grids": [],
        "serve": None,
    }

    def save() -> None:  # after every part: a run cut short keeps what it measured
        result["run_seconds"] = time.perf_counter() - t_start
        write_json(out / f"{NAME}.json", result, indent=1)
        report(result, out)

    if "grid" in args.parts:
        for weights, fields in grid_modes(args.kv_cache_dtype).items():
            result["grids"].append({})
            grid_part(args, weights, fields, result["grids"][-1], save)
    if "serve" in args.parts and not args.smoke:
        from benchmarks.harness.burst import served_burst

        result["serve"] = served_burst(
            args.model, args.serve_batch, args.serve_prompt_len, args.gen, out / f"{NAME}_serve.log",
            server_args=("--quantization", "fp8"),
        )  # fmt: skip
    save()


def report(result: dict[str, Any], out_dir: Path) -> None:
    """fp8_fit.md (and fp8_fit.png) from the JSON."""
    s = result["settings"]
    lines = [
        f"# {s['model']} with FP8 weights on one GPU ({result['device']})",
        "",
        f"torch {result['torch']}, commit {result['commit']}, {result['date']}; dummy weights, bf16 "
        f"activations, the projections FP8 (`--quantization fp8`); bf16 weights would be "
        f"{result['bf16_weights_GiB']:.1f} GiB. Written by `benchmarks/fp8_fit.py`"
        + (" (smoke run on the CPU: no meaning as a measurement)." if s.get("smoke") else "."),
    ]
    for grid in result["grids"]:
        lines += ["", f"## Decode behind one shared prefix: {grid['weights']}", ""]
        for sharing, e in grid["engines"].items():
            lines.append(
                f"- engine with sharing {sharing}: {e['weights_GiB']:.1f} GiB of weights, {e['kv_blocks']:,} "
                f"KV blocks, loaded in {e['load_s']:.0f} s"
            )
        lines += [
            "",
            f"B requests behind one P-token prefix, {s['own']} own tokens each, {s['gen']} generated; "
            "decode tokens/s (first token to last), CUDA graphs; sharing off reads the prefix for every row.",
            "",
            "| B | P | sharing on tok/s | step ms | sharing off tok/s | step ms | on / off | preemptions |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in grid["points"]:
            lines.append("| " + " | ".join(_point_cells(r)) + " |")
    serve = result.get("serve")
    if serve:
        lines += ["", "## `prefixserve serve --quantization fp8`", ""]
        if "error" in serve:
            lines.append(f"Did not serve: {serve['error']}")
        else:
            lines.append(
                f"Healthy {serve['start_s']:.0f} s after start; a burst of {serve['B']} concurrent "
                f"completions "
                f"({s['serve_prompt_len']}-token prompts, {s['gen']} tokens each, after an untimed burst): "
                f"{serve['completion_tokens']:,} tokens in {serve['wall_s']:.2f} s, **{serve['tok_s']:,.0f} "
                "tok/s**."
            )
    write_text(out_dir, f"{NAME}.md", lines)
    _plot(result, out_dir / f"{NAME}.png")


def _point_cells(r: dict[str, Any]) -> list[str]:
    """A grid row's cells; a point whose other mode was not measured (a run cut short) shows "-"."""
    cells = [str(r["B"]), f"{r['P']:,}"]
    for sharing in SHARING:
        m = r.get(sharing)
        cells += [f"{m['tok_s']:,.0f}", f"{m['step_ms']:.1f}"] if m else ["-", "-"]
    cells.append(f"{r['on_over_off']:.2f}x" if "on_over_off" in r else "-")
    cells.append(str(sum(r[m]["preemptions"] for m in SHARING if m in r)))
    return cells


def _plot(result: dict[str, Any], path: Path) -> None:
    """Decode tokens/s per (B, P), sharing on and off, for each grid."""
    plt = pyplot()
    if plt is None or not result["grids"]:
        return
    fig, ax = plt.subplots(figsize=(7, 3.4))
    bars = [(g["weights"], sharing) for g in result["grids"] for sharing in SHARING]
    points = [(r["B"], r["P"]) for r in result["grids"][0]["points"]]
    width = 0.8 / len(bars)
    for i, (weights, sharing) in enumerate(bars):
        grid = next(g for g in result["grids"] if g["weights"] == weights)
        got = {(r["B"], r["P"]): r[sharing]["tok_s"] for r in grid["points"] if sharing in r}
        values = [got.get(point, 0.0) for point in points]  # a run cut short: its points not yet measured
        ax.bar(
            [j + i * width for j in range(len(points))], values, width, label=f"{weights}, sharing {sharing}"
        )
    ax.set_xticks([j + width * (len(bars) - 1) / 2 for j in range(len(points))])
    ax.set_xticklabels([f"B={b}\nP={p}" for b, p in points])
    ax.set_ylabel("decode tokens/s")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_run_args(r: argparse.ArgumentParser) -> None:
    r.add_argument("--model", default="dummy:llama-3.1-70b")
    r.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    r.add_argument("--prefixes", type=int, nargs="+", default=[1024, 16384])
    r.add_argument("--own", type=int, default=64)
    r.add_argument("--gen", type=int, default=64)
    r.add_argument("--parts", nargs="+", default=["grid", "serve"], choices=["grid", "serve"])
    r.add_argument("--kv-cache-dtype", default=None, help="also the grid over this KV cache dtype")
    r.add_argument("--serve-batch", type=int, default=64)
    r.add_argument("--serve-prompt-len", type=int, default=128)
    r.add_argument("--smoke", action="store_true", help="CPU, a tiny model, seconds: the code paths only")


def main() -> None:
    run_or_report(__doc__, NAME, RESULTS, add_run_args, run, report)


if __name__ == "__main__":
    main()
