"""Does ``skinny_matmul.skinny_linear`` read a decode step's weights faster than cuBLAS, and with which tiles?

For Llama-3.1-8B's linear layers (fused qkv, o, fused gate-up, down, lm_head) at 1, 16 and 64 rows:
cuBLAS (``F.linear``) and the skinny kernel over a grid of tiles (BLOCK_N x STAGES),
each timed as a CUDA graph over enough copies of the weight that none stays in L2 (every layer of a
step reads its own weights). Prints the best tiles per shape against cuBLAS and ``skinny_config``'s
pick (None: cuBLAS), and the copy rate measured in the same run; ``--json`` keeps every timing. The
first sweep (2026-11-25, H100) also tried BLOCK_K 256 and split K (2-8 slices, summed by a second
kernel): never better by more than 1%.

PYTHONPATH=. python -m benchmarks.probes.skinny_gemm --rows 1 16 64 [--tp 2]
``--shapes moe_qkv moe_o moe_router moe_lm_head``: Qwen3-30B-A3B's dense products.
(``--tp N``: one rank's shard of each shape: N-th of the columns of qkv, gate-up and lm_head, of the
inputs of o and down)
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from benchmarks.harness.timing import cold_weights, graph_ms, measure_ceilings
from prefixserve.model.kernels import skinny_matmul

COLUMN_PARALLEL = ("qkv", "gate_up", "lm_head")  # sharded by output columns; o and down by input columns
SHAPES = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
MOE_SHAPES = {  # Qwen3-30B-A3B's dense products (--family moe): 2048-wide rows, a 128-expert router
    "moe_qkv": (5120, 2048),
    "moe_o": (2048, 4096),
    "moe_router": (128, 2048),
    "moe_lm_head": (151936, 2048),
}


def configs():
    """(BLOCK_N, STAGES) pairs that fit shared memory at 64 rows."""
    for bn, stages in itertools.product((16, 32, 64, 128), (3, 4, 6, 8, 12)):
        if (bn + 64) * skinny_matmul.BLOCK_K * 2 * stages <= 200 * 1024:
            yield bn, stages


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 16, 64])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=[*SHAPES, *MOE_SHAPES])
    ap.add_argument("--json", default=None)
    ap.add_argument("--tp", type=int, default=1, help="time one tensor-parallel rank's shard of each shape")
    args = ap.parse_args()
    dev = torch.device("cuda")
    copy_tbps, _ = measure_ceilings(dev)
    print(f"copy {copy_tbps:.2f} TB/s")
    rows = []
    for name in args.shapes:
        n, k = {**SHAPES, **MOE_SHAPES}[name]
        n, k = (n // args.tp, k) if name in COLUMN_PARALLEL else (n, k // args.tp)
        ws = cold_weights(n, k)
        floor_ms = n * k * 2 / (copy_tbps * 1e9)
        for m in args.rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = F.linear(x.float(), ws[0].float())
            cublas = graph_ms(lambda i, x=x, ws=ws: F.linear(x, ws[i]), len(ws))
            best = None
            for cfg in configs():
                out = skinny_matmul.skinny_linear(x, ws[0], config=cfg)
                err = float((out.float() - ref).abs().max() / ref.abs().max())
                if err > 1e-2:
                    print(f"  {name} m={m} {cfg}: error {err:.2e}")
                    continue
                ms = graph_ms(
                    lambda i, c=cfg, x=x, ws=ws: skinny_matmul.skinny_linear(x, ws[i], config=c), len(ws)
                )
                rows.append({"shape": name, "m": m, "config": list(cfg), "ms": ms, "cublas_ms": cublas})
                if best is None or ms < best[1]:
                    best = (cfg, ms)
            if best is None:
                print(f"| {name} | {m} | cuBLAS {cublas * 1e3:.1f} us | no tile passed the error check |")
                continue
            default = skinny_matmul.skinny_config(m, n)
            d_ms = next(
                (
                    r["ms"]
                    for r in rows
                    if r["shape"] == name and r["m"] == m and tuple(r["config"]) == default
                ),
                None,
            )
            print(
                f"| {name} | {m} | cuBLAS {cublas * 1e3:.1f} us ({floor_ms / cublas:.0%}) | best {best[0]} "
                f"{best[1] * 1e3:.1f} us ({floor_ms / best[1]:.0%}) | default {default} "
                f"{'-' if d_ms is None else f'{d_ms * 1e3:.1f} us'} |",
                flush=True,
            )
        ws.clear()
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_tbps": copy_tbps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
