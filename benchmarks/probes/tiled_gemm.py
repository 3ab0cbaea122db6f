"""Do tensor-parallel shards' products at 128-512 rows run faster through ``tiled_matmul`` than cuBLAS?

At two ranks a decode step's products are half as wide, and at a few hundred rows cuBLAS's tiles can
leave part of the GPU idle (the o_proj shard of Llama-3.1-8B at 256 rows: 96 x 64 tiles, 1.45 waves
on an H100's 132 SMs, docs/kernels.md §8). For each shape (one rank's shard at ``--tp``) and row
count, cuBLAS (``torch.mm(..., out=)``, as ``fused.linear_into`` runs it) and the tiled kernel over a
grid of tiles and K slices, each timed as a CUDA graph over enough weight copies that none stays in
L2. Every config is checked against the fp32 product first. Prints the best config per point against
cuBLAS and the bound (weight bytes at the copy rate, FLOPs at the GEMM rate, both measured now);
``--json`` keeps every timing.

PYTHONPATH=. python -m benchmarks.probes.tiled_gemm --rows 128 256 512 --json out/tiled.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from benchmarks.harness.timing import graph_ms, measure_ceilings
from prefixserve.model.kernels import tiled_matmul

SHAPES = {  # name: (N, K) of the whole layer; column-parallel shards split N, row-parallel K
    "8b.qkv": (6144, 4096, "col"),
    "8b.o": (4096, 4096, "row"),
    "8b.gate_up": (28672, 4096, "col"),
    "8b.down": (4096, 14336, "row"),
    "70b.o": (8192, 8192, "row"),
    "70b.down": (8192, 28672, "row"),
}
SMEM_LIMIT = 200 * 1024


def configs(m: int, n: int, k: int, sms: int) -> list[tiled_matmul.TileConfig]:
    """Tiles that fit shared memory, whose grid is between half a wave and four waves."""
    out = []
    for bm, bn, stages, warps, split in itertools.product(
        (64, 128), (64, 128, 256), (3, 5), (4, 8), (1, 2, 4)
    ):
        bk = 64
        if (
            stages * (bm + bn) * bk * 2 > SMEM_LIMIT
            or k % (split * bk)
            or (bm == 64 and warps == 8 and bn < 128)
        ):
            continue
        programs = -(-m // bm) * -(-n // bn) * split
        if 0.5 * sms <= programs <= 4 * sms:
            out.append((bm, bn, bk, stages, warps, split))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[128, 256, 512])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    copy_tbps, gemm_tflops = measure_ceilings(dev)
    print(
        f"{torch.cuda.get_device_name(dev)}: copy {copy_tbps:.2f} TB/s, GEMM {gemm_tflops:.0f} TFLOP/s",
        flush=True,
    )
    rows, table = [], []
    for name in args.shapes:
        n, k, split_by = SHAPES[name]
        n, k = (n // args.tp, k) if split_by == "col" else (n, k // args.tp)
        copies = max(2, -(-(256 << 20) // (n * k * 2)))
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
        for m in args.rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            ref = x.float() @ ws[0].float().T
            bound_ms = max(n * k * 2 / (copy_tbps * 1e9), 2 * m * n * k / (gemm_tflops * 1e9))
            cublas = graph_ms(lambda i, x=x, out=out, ws=ws: torch.mm(x, ws[i].t(), out=out), copies)
            best: tuple | None = None
            for cfg in configs(m, n, k, sms):
                try:
                    tiled_matmul.tiled_linear_into(x, ws[0], out, cfg)
                except Exception as exc:  # a config the compiler refuses
                    print(f"  {name} m={m} {cfg}: {type(exc).__name__}")
                    continue
                err = float((out.float() - ref).abs().max() / ref.abs().max())
                if err > 1e-2:
                    print(f"  {name} m={m} {cfg}: error {err:.2e}")
                    continue
                ms = graph_ms(
                    lambda i, c=cfg, x=x, out=out, ws=ws: tiled_matmul.tiled_linear_into(x, ws[i], out, c),
                    copies,
                )
                rows.append(
                    {
                        "shape": name,
                        "n": n,
                        "k": k,
                        "m": m,
                        "config": list(cfg),
                        "ms": ms,
                        "cublas_ms": cublas,
                    }
                )
                if best is None or ms < best[1]:
                    best = (cfg, ms)
            if best is not None:  # after the graph's replays: the split counts left at zero
                out.fill_(0)
                tiled_matmul.tiled_linear_into(x, ws[0], out, best[0])
                err = float((out.float() - ref).abs().max() / ref.abs().max())
                if err > 1e-2:
                    print(f"  {name} m={m} {best[0]}: error {err:.2e} after the timed replays")
                    best = None
            line = {
                "shape": name,
                "n": n,
                "k": k,
                "m": m,
                "cublas_us": cublas * 1e3,
                "bound_us": bound_ms * 1e3,
            }
            if best is not None:
                line |= {"best": list(best[0]), "best_us": best[1] * 1e3, "speedup": cublas / best[1]}
            table.append(line)
            print(
                f"| {name} [{m}, {k}] x [{k}, {n}] | cuBLAS {cublas * 1e3:.1f} us | "
                + (f"tiled {best[1] * 1e3:.1f} us {best[0]} ({cublas / best[1]:.2f}x)" if best else "none")
                + f" | bound {bound_ms * 1e3:.1f} us |",
                flush=True,
            )
        ws.clear()
        torch.cuda.empty_cache()
    if args.json:
        meta = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "sms": sms}
        meta |= {"copy_tbps": copy_tbps, "gemm_tflops": gemm_tflops, "tp": args.tp}
        with open(args.json, "w") as f:
            json.dump({**meta, "table": table, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
