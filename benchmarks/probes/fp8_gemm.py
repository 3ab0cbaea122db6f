"""Probe: one decode-sized product of the 8B shape's layers in bf16 and in FP8, per path, on a GPU.

For M in {1, 16, 64} rows and Llama-3.1-8B's fused qkv, o, gate-up and down shapes: cuBLAS bf16
(``F.linear``), the engine's bf16 path (``fused.linear``: the skinny kernel where it won), the FP8
W8A16 kernel (``fp8_linear``: e4m3 codes converted in registers), the same kernel on x's e4m3 codes
(W8A8: ``quantize_rows`` then FP8 tensor-core products, no conversion) and cuBLASLt's
``torch._scaled_mm`` (with its per-token quantization). Graph replays with L2 flushed; each
path's FP8 output checked against the dequantized product first. Beside each: the weight bytes over
the copy rate measured in the run.

    PYTHONPATH=. python -m benchmarks.probes.fp8_gemm [--out DIR]
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/fp8_gemm")
    args = ap.parse_args()
    rate = copy_rate()
    rows = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        codes, scale = fp8.quantize_rows(w)
        for m in (1, 16, 64):
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
