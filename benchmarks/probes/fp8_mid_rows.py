"""Probe: the 8B shape's four FP8 W8A8 products at 65-1,024 rows (a batched decode step past the
skinny kernel's 64 rows, where the engine runs cuBLASLt's ``torch._scaled_mm``) against the Triton
W8A8 kernel over a grid of tiles, whole or in K slices (fp32 partials [S, M, N], which the norm after
o and down sums, as it sums the bf16 split-K partials at these rows). The gate-up also in its fused
form (SiLU-and-mul in the epilogue, ``GATED``) against ``_scaled_mm`` plus the SiLU-and-mul kernel (with the
down product's codes, as the engine runs it).

x's codes are made beforehand (the kernel before hands them over in a step). Every launch checked
against the dequantized product; us graphed, after a clean L2 flush (``bench_clean_us``); beside each
product its weight bytes over the copy rate and its FLOPs.

    PYTHONPATH=. python -m benchmarks.probes.fp8_mid_rows [--rows 128 256 512] [--out FILE]
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.harness.info import run_info
from benchmarks.harness.timing import bench_clean_us, graphed, measure_ceilings
from benchmarks.probes.fp8_gemm import SHAPES
from benchmarks.probes.fp8_tiles import call
from prefixserve.model import fp8, fused
from prefixserve.model.kernels import fp8_matmul

# (BLOCK_M, BLOCK_N, BLOCK_K, STAGES, warps); the first is the engine's ``LARGE_TILE``
TILES = (
    (64, 128, 128, 3, 4),
    (64, 128, 128, 4, 4),
    (64, 64, 128, 4, 4),
    (64, 128, 256, 3, 4),
    (128, 64, 128, 4, 4),
    (128, 128, 128, 3, 8),
    (128, 128, 128, 4, 8),
    (128, 256, 128, 3, 8),
)
SPLITS = (1, 2, 4)


def _launch(x, xq, codes, scale, out, tile, splits: int, gated: bool = False):
    """One Triton W8A8 launch with these tiles over ``splits`` K slices (out [S, M, N] fp32 past 1)."""
    bm, bn, bk, stages, warps = tile
    return call(x, xq, codes, scale, out, bn, bk, stages, gated, warps, block_m=bm, splits=splits)


def _err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref).norm() / ref.norm())


def product(name: str, m: int, copy_tbps: float) -> dict:
    """``name``'s product at ``m`` rows: cuBLASLt, then every tile and split of the Triton kernel."""
    n, k = SHAPES[name]
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    codes, scale = fp8.quantize_rows(w)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    xq = fp8_matmul.quantize_rows(x)
    ref = (xq[0].float() * xq[1].view(-1, 1)) @ fp8.dequantize(codes, scale).T
    mm = graphed(lambda: fp8.scaled_mm(x, codes, scale, None, None, xq))
    err = _err(fp8.scaled_mm(x, codes, scale, None, None, xq), ref)
    row = {"product": name, "M": m, "N": n, "K": k, "bytes_us": n * k / (copy_tbps * 1e6),
           "GFLOP": 2 * m * n * k / 1e9, "scaled_mm_us": bench_clean_us(mm), "scaled_mm_err": err,
           "tiles": []}  # fmt: skip
    if name == "gate_up":  # the engine's pair past 64 rows: the product, then SiLU-and-mul
        row["scaled_mm_silu_us"] = bench_clean_us(
            graphed(lambda: fused.silu_and_mul(fp8.scaled_mm(x, codes, scale, None, None, xq), quantize=True))
        )
        half = n // 2
        act_ref = torch.nn.functional.silu(ref[:, :half]) * ref[:, half:]
    for tile in TILES:
        for splits in SPLITS:
            if k % (splits * tile[2]):
                continue
            out = torch.empty((splits, m, n) if splits > 1 else (m, n), device="cuda",
                              dtype=torch.float32 if splits > 1 else torch.bfloat16)  # fmt: skip
            try:
                run = _launch(x, xq, codes, scale, out, tile, splits)
                got = run()
                err = _err(got.sum(0) if splits > 1 else got, ref)
                row["tiles"].append({"tile": tile, "splits": splits, "err": err,
                                     "us": bench_clean_us(graphed(run))})  # fmt: skip
            except Exception as exc:  # a tile that does not compile or fit: named, not fatal
                row["tiles"].append({"tile": tile, "splits": splits, "error": repr(exc)[:160]})
        if name == "gate_up":
            out = torch.empty(m, n // 2, device="cuda", dtype=torch.bfloat16)
            try:
                run = _launch(x, xq, codes, scale, out, tile, 1, gated=True)
                err = _err(run(), act_ref)
                row["tiles"].append({"tile": tile, "splits": 1, "gated": True, "err": err,
                                     "us": bench_clean_us(graphed(run))})  # fmt: skip
            except Exception as exc:
                row["tiles"].append({"tile": tile, "splits": 1, "gated": True, "error": repr(exc)[:160]})
    timed = [t for t in row["tiles"] if "us" in t and t["err"] < 2e-2]
    best = min(timed, key=lambda t: t["us"]) if timed else None
    row["best"] = best
    extra = f", cuBLASLt + SiLU-and-mul {row['scaled_mm_silu_us']:.1f}" if name == "gate_up" else ""
    print(f"{name:8s} M={m:5d}: bytes {row['bytes_us']:5.1f} us, cuBLASLt {row['scaled_mm_us']:6.1f}{extra}; "
          f"best Triton {best and best['us']:.1f} at {best and best['tile']} x{best and best['splits']}"
          f"{' gated' if best and best.get('gated') else ''}", flush=True)  # fmt: skip
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[128, 256, 512])
    ap.add_argument("--products", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    copy_tbps, gemm_tflops = measure_ceilings(torch.device("cuda"))
    rows = [product(name, m, copy_tbps) for m in args.rows for name in args.products]
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**run_info(), "copy_TBps": copy_tbps, "bf16_TFLOPs": gemm_tflops, "rows": rows}, f,
                      indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
