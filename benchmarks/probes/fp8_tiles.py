"""Probe: the FP8 decode kernel's tiles (W8A8: x's e4m3 codes, per-channel weight scales) at the 8B
layers' products, swept on a GPU: columns a program (BLOCK_N), columns of K a step (BLOCK_K) and
loads in flight (STAGES), beside the tiles the engine picks (``fp8_matmul.tiles``). Each product
checked against the dequantized reference first; graph replays with L2 flushed, us; the sum over a
layer's four products for the best tile of each against the engine's.

``--gated``: the gate-up product's fused form (``fp8_matmul.fp8_gated``: [2 I, K] codes, SiLU-and-mul
in the epilogue) at the 8B shape instead, BLOCK_N counting each half's columns, with 4 or 8 warps.

    PYTHONPATH=. python -m benchmarks.probes.fp8_tiles [--rows 1 64] [--gated] [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch

from benchmarks.harness.timing import bench_ms, graphed
from benchmarks.probes.fp8_gemm import SHAPES
from prefixserve.model import fp8
from prefixserve.model.kernels import fp8_matmul

BLOCK_N = (16, 32, 64, 128)
BLOCK_K = (256, 512)
STAGES = (4, 6, 8)


def call(x, xq, codes, scale, out, block_n: int, block_k: int, stages: int, gated=False, warps=4,
         block_m: int | None = None, splits: int = 1):  # fmt: skip
    """One launch of the FP8 kernel with these tiles (BLOCK_M as the engine's for x's rows unless
    given); ``splits`` > 1: over that many K slices into fp32 partials ``out`` [S, M, N]."""
    m, k = x.shape
    n = out.shape[-1]
    block_m = block_m or fp8_matmul.tiles(m, n, block_k)[0]
    grid = (-(-n // block_n), -(-m // block_m), splits)
    split = {"SPLIT": True, "K_SLICE": k // splits, "stride_os": out.stride(0)} if splits > 1 else {}

    def run() -> torch.Tensor:
        fp8_matmul._fp8(
            grid, xq[0], codes, scale, out, x, xq[1], m, n, k, xq[0].stride(0), codes.stride(0),
            scale.stride(0), out.stride(-2), HAS_BIAS=False, GROUPED=False, X_CODES=True,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, num_warps=warps, GATED=gated,
            **split,
        )  # fmt: skip
        return out

    return run


def gated_sweep(rows: list[int], rep_ms: int) -> list[dict]:
    """The fused gate-up form's tiles at the 8B shape (I = 14,336, K = 4,096) against the engine's."""
    from prefixserve.model.kernels.silu_mul import silu_and_mul_ref

    inter, k = 14336, 4096
    w = torch.randn(2 * inter, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    codes, scale = fp8.quantize_rows(w)
    found = []
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        xq = fp8_matmul.quantize_rows(x)
        ref = silu_and_mul_ref((xq[0].float() * xq[1]) @ fp8.dequantize(codes, scale).T)
        out = torch.empty(m, inter, device="cuda", dtype=torch.bfloat16)
        engine = 1e3 * bench_ms(graphed(lambda x=x, q=xq: fp8_matmul.fp8_gated(x, codes, scale, q)), rep_ms)
        row = {"layer": "gate_up_gated", "M": m, "N": inter, "K": k, "engine_us": engine, "tiles": {}}
        for bn, bk, st, warps in itertools.product((16, 32, 64), (256,), (2, 3, 4, 6), (4, 8)):
            block_m = fp8_matmul.tiles(m, inter, bk)[0]
            if bk * (block_m + 2 * bn) * st > fp8_matmul.SHARED_BYTES:
                continue
            run = call(x, xq, codes, scale, out, bn, bk, st, gated=True, warps=warps)
            err = float((run().float() - ref).norm() / ref.norm())
            key = f"{bn}x{bk}x{st}w{warps}"
            if err > 2e-2:
                row["tiles"][key] = {"error": err}
                continue
            row["tiles"][key] = {"us": 1e3 * bench_ms(graphed(run), rep_ms)}
        timed = {t: v["us"] for t, v in row["tiles"].items() if "us" in v}
        row["best"] = min(timed, key=timed.get)
        row["best_us"] = timed[row["best"]]
        top = sorted(timed, key=timed.get)[:4]
        print(
            f"gated M={m}: engine {engine:.1f} us; best " + ", ".join(f"{t} {timed[t]:.1f}" for t in top),
            flush=True,
        )
        found.append(row)
    return found


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--rep-ms", type=int, default=25)
    ap.add_argument("--out", default="/tmp/fp8_tiles")
    ap.add_argument("--gated", action="store_true", help="the fused gate-up form alone")
    args = ap.parse_args()
    started, rows = time.perf_counter(), []
    if args.gated:
        rows = gated_sweep(args.rows, args.rep_ms)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        result = {"rows": rows, "wall_s": time.perf_counter() - started}
        (out / "fp8_tiles_gated.json").write_text(json.dumps(result, indent=1))
        return
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        codes, scale = fp8.quantize_rows(w)
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq = fp8_matmul.quantize_rows(x)
            ref = (xq[0].float() * xq[1]) @ fp8.dequantize(codes, scale).T
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            engine = 1e3 * bench_ms(
                graphed(lambda x=x, c=codes, s=scale, q=xq: fp8_matmul.launch(x, c, s, None, None, q)),
                args.rep_ms,
            )
            row = {"layer": name, "M": m, "N": n, "K": k, "engine_us": engine, "tiles": {}}
            for bn, bk, st in itertools.product(BLOCK_N, BLOCK_K, STAGES):
                if bk * (bn + 64) * st > fp8_matmul.SHARED_BYTES:
                    continue
                run = call(x, xq, codes, scale, out, bn, bk, st)
                err = float((run().float() - ref).norm() / ref.norm())
                if err > 1e-2:
                    row["tiles"][f"{bn}x{bk}x{st}"] = {"error": err}
                    continue
                row["tiles"][f"{bn}x{bk}x{st}"] = {"us": 1e3 * bench_ms(graphed(run), args.rep_ms)}
            timed = {t: v["us"] for t, v in row["tiles"].items() if "us" in v}
            row["best"] = min(timed, key=timed.get)
            row["best_us"] = timed[row["best"]]
            rows.append(row)
            print(
                f"{name} M={m}: engine {engine:.1f} us, best {row['best']} {row['best_us']:.1f} us",
                flush=True,
            )
    summary = {}
    for m in args.rows:
        mine = [r for r in rows if r["M"] == m]
        summary[m] = {
            "engine_us": sum(r["engine_us"] for r in mine),
            "best_us": sum(r["best_us"] for r in mine),
        }
        sums = summary[m]
        print(f"M={m}: a layer's products, engine {sums['engine_us']:.1f} us, best {sums['best_us']:.1f} us")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"rows": rows, "summary": summary, "wall_s": time.perf_counter() - started}
    (out / "fp8_tiles.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
