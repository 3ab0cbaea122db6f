"""Probe: one decode-sized product of the 8B shape's layers in bf16 and in FP8, per path, on a GPU.

For M in {1, 16, 64} rows (``--rows``: others, such as cuBLASLt's range past 64) and Llama-3.1-8B's
fused qkv, o, gate-up and down shapes: cuBLAS bf16
(``F.linear``), the engine's bf16 path (``fused.linear``: the skinny kernel where it won), the FP8
W8A16 kernel (``fp8_linear``: e4m3 codes converted in registers), the same kernel on x's e4m3 codes
(W8A8: ``quantize_rows`` then FP8 tensor-core products, no conversion) and cuBLASLt's
``torch._scaled_mm`` (with its per-token quantization). Graph replays with L2 flushed; each
path's FP8 output checked against the dequantized product first. Beside each: the weight bytes over
the copy rate measured in the run.

``--prefill``: the same four products at a prefill's 8,192 rows, where the FP8 GEMM is compute-bound:
cuBLAS bf16 against ``torch._scaled_mm`` with and without fast accumulation, each with and without
the per-token quantization of x (``quantize_rows``, timed alone too), in TFLOP/s.

    PYTHONPATH=. python -m benchmarks.probes.fp8_gemm [--prefill] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.harness.timing import bench_ms, graphed
from prefixserve.model import fp8, fused
from prefixserve.model.kernels.fp8_matmul import fp8_linear, quantize_rows

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def copy_rate() -> float:
    """Device-to-device copy, bytes a second (read + write counted)."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = bench_ms(lambda: b.copy_(a))
    return 2 * a.numel() / (ms * 1e-3)


PREFILL_ROWS = 8192


def prefill_rows() -> list[dict]:
    """Each product at ``PREFILL_ROWS`` rows: us and TFLOP/s a path, errors against the dequantized
    product (x rounded to e4m3 as the path does)."""
    rows = []
    m = PREFILL_ROWS
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        codes, scale = fp8.quantize_rows(w)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        xq, sx = quantize_rows(x)
        wt, sw = codes.t(), scale.view(1, -1)

        def mm(fast: bool, xq=xq, sx=sx, wt=wt, sw=sw) -> torch.Tensor:
            return torch._scaled_mm(
                xq, wt, scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16, use_fast_accum=fast
            )

        def quantized_mm(fast: bool, x=x, wt=wt, sw=sw) -> torch.Tensor:
            q, s_ = quantize_rows(x)
            return torch._scaled_mm(
                q, wt, scale_a=s_, scale_b=sw, out_dtype=torch.bfloat16, use_fast_accum=fast
            )

        paths = {
            "bf16_cublas": lambda x=x, w=w: F.linear(x, w),
            "quantize_rows": lambda x=x: quantize_rows(x),
            "scaled_mm": lambda: mm(False),
            "scaled_mm_fast": lambda: mm(True),
            "quantize_scaled_mm": lambda: quantized_mm(False),
            "quantize_scaled_mm_fast": lambda: quantized_mm(True),
        }
        ref = (xq.float() * sx) @ fp8.dequantize(codes, scale).T
        row = {"layer": name, "M": m, "N": n, "K": k}
        for path, fn in paths.items():
            if path.startswith("scaled_mm"):
                got = fn().float()
                row[path + "_err"] = float((got - ref).norm() / ref.norm())
                row[path + "_max_err"] = float(((got - ref).abs() / ref.abs().clamp_min(1e-2)).max())
            us = 1e3 * bench_ms(graphed(fn))
            row[path + "_us"] = us
            if path != "quantize_rows":
                row[path + "_TFLOPs"] = 2 * m * n * k / (us * 1e-6) / 1e12
        rows.append(row)
        cells = " ".join(f"{p}={row[p + '_us']:.0f}" for p in paths)
        errs = f"fast err {row['scaled_mm_fast_err']:.2e} vs {row['scaled_mm_err']:.2e}"
        print(f"{name} M={m}: {cells} us; {errs}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/fp8_gemm")
    ap.add_argument("--prefill", action="store_true", help="the products at 8,192 rows (prefill)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64], help="M of the decode products")
    args = ap.parse_args()
    if args.prefill:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "fp8_gemm_prefill.json").write_text(json.dumps({"rows": prefill_rows()}, indent=1))
        return
    rate = copy_rate()
    rows = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        codes, scale = fp8.quantize_rows(w)
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            paths = {
                "bf16_cublas": lambda x=x, w=w: F.linear(x, w),
                "bf16_engine": lambda x=x, w=w: fused.linear(x, w, None),
                "fp8_w8a16": lambda x=x, c=codes, s=scale: fp8_linear(x, c, s),
                "fp8_w8a8_triton": lambda x=x, c=codes, s=scale: fp8_linear(
                    x, c, s, x_codes=quantize_rows(x)
                ),
                "fp8_scaled_mm": lambda x=x, c=codes, s=scale: fp8.scaled_mm(x, c, s, None, None),
            }
            row = {"layer": name, "M": m, "N": n, "K": k}
            row["bf16_bound_us"] = 1e6 * n * k * 2 / rate
            row["fp8_bound_us"] = 1e6 * n * k / rate
            ref = (x.float() @ fp8.dequantize(codes, scale).T).float()
            for path, fn in paths.items():
                try:
                    got = fn().float()
                    if path.startswith("fp8"):
                        row[path + "_err"] = float((got - ref).norm() / ref.norm())
                    row[path + "_us"] = 1e3 * bench_ms(graphed(fn))
                except Exception as exc:
                    row[path + "_error"] = repr(exc)[:200]
            rows.append(row)
            cells = " ".join(f"{p}={row.get(p + '_us', float('nan')):.1f}" for p in paths)
            print(f"{name} M={m}: fp8 bound {row['fp8_bound_us']:.1f} us; {cells}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8_gemm.json").write_text(json.dumps({"copy_TBps": rate / 1e12, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
