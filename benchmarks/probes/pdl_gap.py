"""Does programmatic dependent launch (PDL) shorten a graphed decode step's kernel-to-kernel gaps?

A CUDA graph of ``--layers`` x [cuBLAS GEMM (M=--rows, 4096 x 4096), RMSNorm kernel] and one of
``--layers`` x 4 RMSNorm kernels back to back, each with the RMSNorm launched plainly or with PDL
(``launch_pdl=True`` and ``griddepcontrol.wait`` at its top). Prints replay times (ms) and the
saving per PDL launch (us). H100/H200 only.

PYTHONPATH=. python -m benchmarks.probes.pdl_gap
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from benchmarks.attention import _bench


@triton.jit
def _norm(x_ptr, w_ptr, out_ptr, n, eps, BLOCK: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # weights: no dependency
    if PDL:
        gdc_wait()
    if EARLY:
        gdc_launch_dependents()
    x = tl.load(x_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / n + eps)
    tl.store(out_ptr + row * n + cols, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def measure(rows: int, layers: int, w: torch.Tensor, mats: list[torch.Tensor]) -> None:
    n = w.shape[0]
    bufs = [torch.randn(rows, n, device=w.device, dtype=torch.bfloat16) for _ in range(2)]

    def norm(src, dst, pdl: bool, early: bool) -> None:
        _norm[(rows,)](src, w, dst, n, 1e-5, BLOCK=n, PDL=pdl, EARLY=early, num_warps=8, launch_pdl=pdl)

    def gemm_chain(pdl: bool, early: bool) -> None:
        for i in range(layers):
            torch.mm(bufs[0], mats[i % 4], out=bufs[1])
            norm(bufs[1], bufs[0], pdl, early)

    def norm_chain(pdl: bool, early: bool) -> None:
        for _ in range(layers * 4):
            norm(bufs[0], bufs[1], pdl, early)
            norm(bufs[1], bufs[0], pdl, early)

    for name, chain, launches in (("gemm+norm", gemm_chain, layers), ("norm only", norm_chain, 8 * layers)):
        times = {}
        for label, pdl, early in (("plain", False, False), ("pdl", True, False), ("pdl+early", True, True)):
            chain(pdl, early)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                chain(pdl, early)
            times[label] = _bench(g.replay, 200)
        base = times["plain"]
        cells = ", ".join(
            f"{k} {v:.3f} ms ({(base - v) / launches * 1e3:+.2f} us a launch)" for k, v in times.items()
        )
        print(f"rows {rows} {name}: {cells}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--layers", type=int, default=32)
    args = ap.parse_args()
    n = 4096
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    mats = [torch.randn(n, n, device="cuda", dtype=torch.bfloat16) / 64 for _ in range(4)]
    for rows in args.rows:
        measure(rows, args.layers, w, mats)


if __name__ == "__main__":
    main()
