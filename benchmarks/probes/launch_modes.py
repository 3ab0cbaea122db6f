"""One decode attention call of a one-segment step under each launch, and the parts of the two-kernel call.

Modes: two kernels (shared Gluon kernel on a side stream beside the own kernel, then the merge; the
shared tiles as the planner picks them, 192 rows where ``shared_plan.wide_tiles_pay``), the same on
128-row tiles (``two_kernels128``) or with the Triton shared kernel (``two_kernels_triton``), and the
mixed kernel with 64- or 128-row own tiles. Each call is timed as a CUDA graph replay
(``benchmarks.harness.timing.bench_ms``: median, L2 flushed), and with ``--sustained S`` also back to
back for S seconds with the board's power (``benchmarks.power``: at the power cap a call's energy is
what sets a decode step's time); the two-kernel call's launches are also timed alone (shared kernel,
own kernel, merge). ``--heads 32/4`` sets query / KV heads (default the 8B's 32/8; 32/4 is the 70B's
TP=2 shard). T* as in attention.py, from ceilings measured in the run. Points are BxPxS (sequences,
shared prefix tokens, own tokens each). ``--kv-dtype fp8``: the caches in e4m3, as an FP8 KV cache
holds them (the mixed kernel then runs two kernels); mode ``two_kernels_fp8mma`` runs the
shared part's products on FP8 tensor cores (``shared_gluon_fp8``). The
phased kernel this probe was first written for (shared tickets, then own ones, in one launch) is in
git history at a891d3d (docs/kernels.md §4).

PYTHONPATH=. python -m benchmarks.probes.launch_modes --points 64x16384x128 64x65536x128
PYTHONPATH=. python -m benchmarks.probes.launch_modes --heads 32/4 --points 256x16384x128 \
    --modes mixed64 two_kernels two_kernels128 --sustained 2
PYTHONPATH=. python -m benchmarks.probes.launch_modes --kv-dtype fp8 --modes two_kernels two_kernels_triton
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from benchmarks.attention import HKV, HQ, Case
from benchmarks.harness.info import run_info
from benchmarks.harness.timing import bench_ms, graphed, measure_ceilings, time_launches
from prefixserve.attention.kernels import shared_gluon, shared_gluon_fp8
from prefixserve.attention.planning import mixed_rule, shared_plan
from prefixserve.attention.triton_backend import TritonBackend

OWN_ROWS_FOR = mixed_rule.own_rows_for
WIDE_TILES_PAY = shared_plan.wide_tiles_pay
GLUON = shared_gluon.GLUON
# (mixed launch, own rows forced, 192-row shared tiles allowed, the Gluon shared kernel, the shared
# part's products on FP8 tensor cores over an e4m3 cache)
MODES = {
    "two_kernels": (False, None, True, True, False),
    "two_kernels128": (False, None, False, True, False),
    "two_kernels_triton": (False, None, False, False, False),
    "two_kernels_fp8mma": (False, None, False, True, True),
    "mixed64": (True, 64, True, True, False),
    "mixed128": (True, 128, True, True, False),
}


def call(case: Case, mode: str):
    """The whole attention call of ``case`` under ``mode``, graphed; and its layout."""
    mixed, own_m, wide, gluon, fp8_products = MODES[mode]
    mixed_rule.own_rows_for = (lambda *a: own_m) if own_m else OWN_ROWS_FOR
    shared_plan.wide_tiles_pay = WIDE_TILES_PAY if wide else (lambda *a: False)
    shared_gluon.GLUON = GLUON and gluon
    be = TritonBackend()
    be.mixed = mixed
    be.overlap_min_rows = 0  # the shared kernel on a side stream, as in the decode graphs
    meta = dataclasses.replace(case.meta, plan=None, stats={})
    with shared_gluon_fp8.products(fp8_products):  # the launches are recorded under it, then replayed
        be.prepare(meta)
        out = be.forward(case.q, case.k_cache, case.v_cache, meta, case.scale)
        lay = next(iter(meta.plan.layouts.values()))
        fn = graphed(lambda: be.forward(case.q, case.k_cache, case.v_cache, meta, case.scale))
    return fn, lay, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", nargs="+", default=["64x16384x128", "256x16384x128", "1024x16384x128"])
    ap.add_argument("--modes", nargs="+", default=["two_kernels", "mixed64"], choices=list(MODES))
    ap.add_argument("--heads", default=f"{HQ}/{HKV}", help="query / KV heads, e.g. 32/4")
    ap.add_argument("--sustained", type=float, default=0.0, help="also S seconds back to back, with power")
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--kv-dtype",
        choices=["bf16", "fp8"],
        default="bf16",
        help="fp8: the caches in e4m3 (an FP8 KV cache)",
    )
    args = ap.parse_args()
    heads = tuple(int(x) for x in args.heads.split("/"))
    dev = torch.device("cuda")
    copy_tbps, gemm_tflops = measure_ceilings(dev)
    print(f"copy {copy_tbps:.2f} TB/s, GEMM {gemm_tflops:.0f} TFLOP/s")
    sampler = None
    if args.sustained:
        from benchmarks import power

        sampler = power.Sampler(gpu=str(dev.index or 0))
    rows = []
    for point in args.points:
        b, p, s = (int(x) for x in point.split("x"))
        case = Case(b, p, s, dev, heads=heads)
        if args.kv_dtype == "fp8":  # the same values rounded to e4m3 (randn lies well inside its range)
            case.k_cache, case.v_cache = (c.to(torch.float8_e4m3fn) for c in (case.k_cache, case.v_cache))
        bytes_ms, flops_ms = case.roofline(copy_tbps, gemm_tflops)
        row = {"B": b, "P": p, "S": s, "t_star_us": 1e3 * max(bytes_ms, flops_ms), "own_bytes_us": 0.0}
        ref = None
        for mode in args.modes:
            fn, lay, out = call(case, mode)
            if ref is None:
                ref = out.float()
            err = float((out.float() - ref).abs().max() / ref.abs().max())
            row[mode] = 1e3 * bench_ms(fn)
            row[f"{mode}_err"] = err
            row[f"{mode}_shared_rows"] = lay.work.block_m
            if sampler is not None:
                st = power.sustained(fn, sampler, args.sustained)
                row[f"{mode}_sustained"] = 1e3 * st["ms"]
                row[f"{mode}_mJ"] = st["ms"] * (st["power_w"] or float("nan"))
            if mode.startswith("two_kernels"):
                tensors = (case.q, case.k_cache, case.v_cache, torch.empty_like(case.q))
                parts = time_launches(lay.launches, tensors).items()
                prefix = "part_" if mode == "two_kernels" else f"{mode}_part_"
                row |= {f"{prefix}{k}": 1e3 * v for k, v in parts}
        row["own_bytes_us"] = 1e6 * b * s * case.hkv * 128 * 2 * 2 / (copy_tbps * 1e12)
        rows.append(row)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    print("| B | P | S | T* us | " + " | ".join(args.modes) + " | shared alone | own alone | merge |")
    for r in rows:
        cells = [f"{r[m]:.1f}" for m in args.modes]
        parts = [f"{r.get(k, float('nan')):.1f}" for k in ("part_shared", "part_own", "part_merge")]
        head = f"| {r['B']} | {r['P']} | {r['S']} | {r['t_star_us']:.1f} | "
        print(head + " | ".join(cells + parts) + " |")
    if sampler is not None:
        print("\nBack to back, us a call (mJ a call):")
        print("| B | P | S | " + " | ".join(args.modes) + " |")
        for r in rows:
            cells = [f"{r[m + '_sustained']:.1f} ({r[m + '_mJ']:.1f})" for m in args.modes]
            print(f"| {r['B']} | {r['P']} | {r['S']} | " + " | ".join(cells) + " |")
        sampler.close()
    if args.json:
        with open(args.json, "w") as f:
            payload = run_info() | {"copy_tbps": copy_tbps, "gemm_tflops": gemm_tflops, "rows": rows}
            json.dump(payload, f, indent=1)


if __name__ == "__main__":
    main()
