"""Whether a decode step's linear layers would run faster with their weights stored the other way round.

The loader keeps each weight as ``[out, in]`` and the model multiplies ``x @ W.T`` (cuBLAS "TN"). This
times ``torch.mm`` of the 8B's projections at TP=1 and at TP=2's shard shapes, both layouts (``W.T``
of an ``[N, K]`` weight, and a contiguous ``[K, N]`` weight: "NN"), and the first with PyTorch's
reduced-precision bf16 reductions off, and the first through cuBLASLt (``preferred_blas_library``:
its heuristic picks another kernel for some shapes). Each call reads a different copy of the weight,
graphed, so L2 holds none of it (``benchmarks/harness/timing.graph_ms``); the two layouts' products
are compared.

PYTHONPATH=. python -m benchmarks.probes.gemm_layout --json out/gemm_layout.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.harness.info import git_commit
from benchmarks.harness.timing import graph_ms

# (K, N) of each projection at TP=2; at TP=1 the sharded dimension doubles (K for o and down)
SHARDS = {"qkv": (4096, 3072), "o": (2048, 4096), "gate_up": (4096, 14336), "down": (7168, 4096)}
COPIES = 8


def _shape(name: str, tp: int) -> tuple[int, int]:
    k, n = SHARDS[name]
    if tp == 1:
        return (2 * k, n) if name in ("o", "down") else (k, 2 * n)
    return k, n


def measure(rows: int, k: int, n: int, device: torch.device) -> dict[str, float]:
    """Microseconds a call: TN, NN, TN without reduced-precision reductions, TN through cuBLASLt;
    and max |TN - NN|."""
    weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) / 64 for _ in range(COPIES)]
    transposed = [w.t().contiguous() for w in weights]
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    out = torch.empty(rows, n, device=device, dtype=torch.bfloat16)
    matmul = torch.backends.cuda.matmul
    result = {
        "TN_us": graph_ms(lambda i: torch.mm(x, weights[i].t(), out=out), COPIES) * 1e3,
        "NN_us": graph_ms(lambda i: torch.mm(x, transposed[i], out=out), COPIES) * 1e3,
    }
    before = matmul.allow_bf16_reduced_precision_reduction
    matmul.allow_bf16_reduced_precision_reduction = False
    try:
        result["TN_no_reduced_us"] = graph_ms(lambda i: torch.mm(x, weights[i].t(), out=out), COPIES) * 1e3
    finally:
        matmul.allow_bf16_reduced_precision_reduction = before
    blas = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")  # the same call, through cuBLASLt's heuristic
    try:
        result["TN_lt_us"] = graph_ms(lambda i: torch.mm(x, weights[i].t(), out=out), COPIES) * 1e3
    finally:
        torch.backends.cuda.preferred_blas_library(blas)
    diff = (x @ weights[0].t()).float() - (x @ transposed[0]).float()
    result["max_abs_diff"] = float(diff.abs().max())
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256, 512])
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 1])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    results = []
    for tp in args.tp:
        for name in SHARDS:
            k, n = _shape(name, tp)
            for rows in args.rows:
                r = {"tp": tp, "layer": name, "rows": rows, "K": k, "N": n, **measure(rows, k, n, device)}
                results.append(r)
                print(
                    f"TP={tp} {name:8s} {rows:4d}x{k}x{n}: TN {r['TN_us']:6.1f} us, NN {r['NN_us']:6.1f} "
                    f"({r['TN_us'] / r['NN_us']:.2f}x), TN without reduced reductions "
                    f"{r['TN_no_reduced_us']:6.1f}, TN via cuBLASLt {r['TN_lt_us']:6.1f}; "
                    f"max |TN - NN| {r['max_abs_diff']:.3g}",
                    flush=True,
                )
    if args.json:
        info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": git_commit()}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**info, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
