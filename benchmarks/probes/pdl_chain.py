"""Probe: programmatic dependent launch (``triton_support/pdl.py``) on a decode step's dense chain.

A layer of the Llama-3.1-8B shape without its attention (the attention output stood in by the first
4,096 columns of qkv): add + RMSNorm, qkv, o, add + RMSNorm, gate-up, SiLU-and-mul, down, in bf16
(the skinny kernels where they are faster, else cuBLAS, as the engine) and with FP8 weights (W8A8:
the norm and SiLU kernels hand over the codes, the attention output quantized by its own kernel).
``--layers`` layers, each with its own weights (8 GB of FP8, 15 GB of bf16 at 32: no layer in L2
when it comes round), captured in one CUDA graph with PDL off and on (``pdl.ENABLED``), each chain's
output checked equal bit for bit. (A first form also asked L2 for the first bytes of each product's
weight rows before its wait: 4, 16 and 32 MB a product took 83.5-105.4 us a layer at one FP8 row
against 86.2 without, and slowed bf16; not kept.) Per layer us
(median of five timings of ``--reps`` replays), against the weights' bytes over the copy rate
measured in the same run.

    PYTHONPATH=. python -m benchmarks.probes.pdl_chain [--rows 1 64] [--layers 32] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.harness import run_info
from benchmarks.harness.timing import measure_ceilings
from prefixserve.model import fp8
from prefixserve.model.kernels import fp8_matmul, rms_norm, silu_mul, skinny_matmul
from prefixserve.triton_support import pdl

HIDDEN, QKV, INTER = 4096, 6144, 14336
VARIANTS = {"off": False, "pdl": True}  # pdl.ENABLED


def bf16_layer() -> dict[str, torch.Tensor]:
    """One layer's bf16 weights (qkv, o, stacked gate-up, down) and norm weights."""
    dev = "cuda"

    def w(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5

    return {
        "qkv": w(QKV, HIDDEN),
        "o": w(HIDDEN, HIDDEN),
        "gate_up": w(2 * INTER, HIDDEN),
        "down": w(HIDDEN, INTER),
        "norm1": torch.ones(HIDDEN, device=dev, dtype=torch.bfloat16),
        "norm2": torch.ones(HIDDEN, device=dev, dtype=torch.bfloat16),
    }


def fp8_layer(layer: dict[str, torch.Tensor]) -> dict[str, object]:
    """The layer's products as e4m3 codes with per-channel scales (``fp8.quantize_rows``)."""
    out: dict[str, object] = {k: layer[k] for k in ("norm1", "norm2")}
    for name in ("qkv", "o", "gate_up", "down"):
        out[name] = fp8.quantize_rows(layer[name])
    return out


def linear_bf16(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = skinny_matmul.linear_if_faster(x, w)
    return F.linear(x, w) if y is None else y


def chain_bf16(layers: list, x: torch.Tensor) -> torch.Tensor:
    resid = torch.zeros_like(x)
    for lw in layers:
        h, resid = rms_norm.add_rms_norm(x, lw["norm1"], 1e-5, resid)
        qkv = linear_bf16(h, lw["qkv"])
        o = linear_bf16(qkv[:, :HIDDEN], lw["o"])
        h, resid = rms_norm.add_rms_norm(o, lw["norm2"], 1e-5, resid)
        config = skinny_matmul.gated_config(h.shape[0], INTER)
        if config is not None:
            act = skinny_matmul.gated(h, lw["gate_up"], config)
        else:
            act = silu_mul.silu_and_mul(F.linear(h, lw["gate_up"]))
        x = linear_bf16(act, lw["down"])
    return x + resid


def chain_fp8(layers: list, x: torch.Tensor) -> torch.Tensor:
    resid = torch.zeros_like(x)
    for lw in layers:
        h, resid, codes, scales = rms_norm.add_rms_norm(x, lw["norm1"], 1e-5, resid, quantize=True)
        qkv = fp8_matmul.launch(h, *lw["qkv"], None, None, (codes, scales))
        attn = qkv[:, :HIDDEN]
        o = fp8_matmul.launch(attn, *lw["o"], None, None, fp8_matmul.quantize_rows(attn))
        h, resid, codes, scales = rms_norm.add_rms_norm(o, lw["norm2"], 1e-5, resid, quantize=True)
        gu = fp8_matmul.launch(h, *lw["gate_up"], None, None, (codes, scales))
        act, codes, scales = silu_mul.silu_and_mul_quantize(gu)
        x = fp8_matmul.launch(act, *lw["down"], None, None, (codes, scales))
    return x + resid


def capture(fn, x: torch.Tensor) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """fn(x) warmed up on a side stream and captured; the graph and its output tensor."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(x)
    graph.replay()
    torch.cuda.synchronize()
    return graph, out


def replay_ms(graph: torch.cuda.CUDAGraph, reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return sorted(times)[2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2, help="variants timed in turn, this many times")
    ap.add_argument("--out", default="/tmp/pdl_chain")
    args = ap.parse_args()
    started = time.perf_counter()
    copy_tbps, gemm_tflops = measure_ceilings(torch.device("cuda"))
    bf16_layers = [bf16_layer() for _ in range(args.layers)]
    fp8_layers = [fp8_layer(lw) for lw in bf16_layers]
    bytes_layer = {
        "bf16": 2 * HIDDEN * (QKV + HIDDEN + 3 * INTER),
        "fp8": HIDDEN * (QKV + HIDDEN + 3 * INTER),
    }
    rows, was = [], pdl.ENABLED
    try:
        for m in args.rows:
            x = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16)
            for dtype, fn, layers in (("bf16", chain_bf16, bf16_layers), ("fp8", chain_fp8, fp8_layers)):
                graphs, outs = {}, {}
                for name, flag in VARIANTS.items():
                    pdl.ENABLED = flag
                    graphs[name], outs[name] = capture(lambda t, f=fn, lay=layers: f(lay, t), x)
                same = {n: bool(torch.equal(outs[n], outs["off"])) for n in outs}
                times: dict[str, list[float]] = {n: [] for n in graphs}
                for _ in range(args.rounds):
                    for n, g in graphs.items():
                        times[n].append(1e3 * replay_ms(g, args.reps) / args.layers)
                bound_us = bytes_layer[dtype] / (copy_tbps * 1e12) * 1e6
                row = {
                    "rows": m,
                    "dtype": dtype,
                    "bytes_bound_us": bound_us,
                    "layer_us": {n: min(t) for n, t in times.items()},
                    "layer_us_rounds": times,
                    "equal_to_off": same,
                }
                rows.append(row)
                print(
                    f"M={m} {dtype}: off {row['layer_us']['off']:.1f} us/layer, pdl "
                    f"{row['layer_us']['pdl']:.1f}, bytes {bound_us:.1f}, equal {same}",
                    flush=True,
                )
                del graphs, outs
                torch.cuda.empty_cache()
    finally:
        pdl.ENABLED = was
    print("\nrows dtype  bytes-us  " + "  ".join(f"{n:>10}" for n in VARIANTS))
    for r in rows:
        cells = "  ".join(f"{r['layer_us'][n]:10.1f}" for n in VARIANTS)
        print(f"{r['rows']:4d} {r['dtype']:5s} {r['bytes_bound_us']:8.1f}  {cells}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "info": run_info(),
        "copy_tbps": copy_tbps,
        "gemm_tflops": gemm_tflops,
        "layers": args.layers,
        "rows": rows,
        "wall_s": time.perf_counter() - started,
    }
    (out / "pdl_chain.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
