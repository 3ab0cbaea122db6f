"""Where does the tiled matmul (``model/kernels/tiled_matmul.py``) beat cuBLAS at decode row counts?

Llama-3.1-8B's projections (fused qkv, o, down, the fused gate-up as a plain GEMM) at 129 to 2,048
rows: cuBLAS (``F.linear``) against the tiled kernel over a grid of tiles, each timed as a CUDA
graph over enough weight copies that none stays in L2 (as the engine's layers read theirs). Prints
per product and row count cuBLAS's time, the best tiles and their ratio; ``--json`` keeps every
timing. ``--ab N``: no sweep; cuBLAS and ``fused.linear``'s rule in turn N times per point (a sweep's
last timings run on a hotter GPU than its first). ``--engine-ab N``: decode steps of the engine
(attention="none", as ``benchmarks/dense.py``) with the kernel on and off, N rounds.

PYTHONPATH=. python -m benchmarks.probes.tiled_gemm --rows 256 512 1024
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from benchmarks.attention import measure_ceilings
from benchmarks.probes.skinny_gemm import graph_ms
from prefixserve.model import fused
from prefixserve.model.kernels import tiled_matmul

PRODUCTS = {  # name -> (N, K) of Llama-3.1-8B
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
}


def configs():
    """(BLOCK_M, BLOCK_N, BLOCK_K, STAGES, warps) that fit shared memory and registers."""
    for bm, bn, stages, warps in itertools.product((64, 128), (64, 128, 256), (3, 4, 5), (4, 8)):
        bk = 64
        if (bm + bn) * bk * 2 * stages > 220 * 1024 or bm * bn // (32 * warps) > 128:
            continue
        if warps == 8 and bm * bn < 128 * 128:
            continue
        yield bm, bn, bk, stages, warps


def weights(n: int, k: int, dev: torch.device) -> list[torch.Tensor]:
    copies = max(2, -(-(256 << 20) // (n * k * 2)))
    return [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / 32 for _ in range(copies)]


def sweep(rows: list[int], names: list[str]) -> dict:
    dev = torch.device("cuda")
    copy_tbps, gemm_tflops = measure_ceilings(dev)
    print(f"copy {copy_tbps:.2f} TB/s, GEMM {gemm_tflops:.0f} TFLOP/s", flush=True)
    table, timings = [], []
    for name in names:
        n, k = PRODUCTS[name]
        ws = weights(n, k, dev)
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = F.linear(x.float(), ws[0].float())
            scale = float(ref.abs().max())
            floor = max(n * k * 2 / (copy_tbps * 1e9), 2 * m * n * k / (gemm_tflops * 1e9))
            cublas = graph_ms(lambda i, x=x, ws=ws: F.linear(x, ws[i]), len(ws))
            best = None
            for cfg in configs():
                try:
                    out = tiled_matmul.tiled_linear(x, ws[0], None, cfg)
                    torch.cuda.synchronize()
                except Exception as exc:  # a tile that does not compile or launch
                    print(f"  {name} m={m} {cfg}: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
                    continue
                err = float((out.float() - ref).abs().max()) / scale
                if err > 1e-2:
                    print(f"  {name} m={m} {cfg}: error {err:.2e}", flush=True)
                    continue
                ms = graph_ms(
                    lambda i, x=x, cfg=cfg, ws=ws: tiled_matmul.tiled_linear(x, ws[i], None, cfg), len(ws)
                )
                timings.append({"product": name, "m": m, "config": list(cfg), "ms": ms})
                if best is None or ms < best[0]:
                    best = (ms, cfg)
            line = {"product": name, "m": m, "cublas_ms": cublas, "floor_ms": floor,
                    "best_ms": best[0] if best else None, "best_config": list(best[1]) if best else None}
            table.append(line)
            b = "-" if best is None else f"{best[0] * 1e3:.1f} us {best[1]} ({cublas / best[0]:.2f}x)"
            print(f"| {name} | {m} | cuBLAS {cublas * 1e3:.1f} us | best tiled {b} | "
                  f"floor {floor * 1e3:.1f} us |", flush=True)  # fmt: skip
    return {"copy_tbps": copy_tbps, "gemm_tflops": gemm_tflops, "table": table, "timings": timings}


def ab(rows: list[int], names: list[str], rounds: int) -> list[dict]:
    """cuBLAS and ``fused.linear`` (its rules: skinny, tiled, else cuBLAS) in turn, ``rounds`` times."""
    dev = torch.device("cuda")
    out = []
    for name in names:
        n, k = PRODUCTS[name]
        ws = weights(n, k, dev)
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            base, rule = [], []
            for _ in range(rounds):
                base.append(graph_ms(lambda i, x=x, ws=ws: F.linear(x, ws[i]), len(ws)))
                rule.append(graph_ms(lambda i, x=x, ws=ws: fused.linear(x, ws[i]), len(ws)))
            b, r = sorted(base)[rounds // 2], sorted(rule)[rounds // 2]
            cfg = tiled_matmul.tiled_config(m, n, k)
            out.append({"product": name, "m": m, "cublas_ms": b, "rule_ms": r, "config": cfg})
            print(f"| {name} | {m} | cuBLAS {b * 1e3:.1f} us | rule {r * 1e3:.1f} us {cfg} | "
                  f"cuBLAS / rule {b / r:.3f} |", flush=True)  # fmt: skip
    return out


def engine_ab(batches: list[int], rounds: int) -> list[dict]:
    """Decode steps of the engine with the tiled kernel on and off, a fresh engine each time (graphs
    capture the switch's choice), in turn ``rounds`` times."""
    from benchmarks.dense import _collect, _engine, engine_decode

    args = argparse.Namespace(model="dummy:llama-3.1-8b", dtype="bfloat16", batches=batches, prefill_tokens=0)
    args.prompt_len, args.gen = 64, 64
    times: dict[tuple[int, bool], list[float]] = {(b, on): [] for b in batches for on in (True, False)}
    for _ in range(rounds):
        for on in (True, False):
            with fused.tiled_matmuls(on):
                llm = _engine(args)
                for b in batches:
                    times[b, on].append(engine_decode(llm, b, args.prompt_len, args.gen)["ms"])
                del llm
                _collect()
    out = []
    for b in batches:
        on, off = (sorted(times[b, x]) for x in (True, False))
        ratio = off[rounds // 2] / on[rounds // 2]
        out.append({"B": b, "on_ms": on, "off_ms": off, "off_over_on": ratio})
        print(f"| B={b} | tiled on {on} ms | off {off} ms | off / on (medians) {ratio:.3f} |", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", nargs="+", type=int, default=[192, 256, 384, 512, 768, 1024, 2048])
    ap.add_argument("--products", nargs="+", default=list(PRODUCTS), choices=list(PRODUCTS))
    ap.add_argument("--ab", type=int, default=0)
    ap.add_argument("--engine-ab", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.engine_ab:
        result = {"engine_ab": engine_ab(args.rows, args.engine_ab)}
    elif args.ab:
        result = {"ab": ab(args.rows, args.products, args.ab)}
    else:
        result = sweep(args.rows, args.products)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
