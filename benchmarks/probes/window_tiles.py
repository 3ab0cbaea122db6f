"""Which tiles make the window kernel's decode walk run nearest the copy rate?

Backs the window kernel's launch settings (``attention/kernels/window_attention.py``). A Gemma-3-12B
sliding layer's decode step, alone: B rows (16 query heads, 8 KV heads of 256), each sequence
``--len`` keys long with a ``--window``-key window, its shared segments' run (``--skip`` keys before
its own tail) stepped over, as the window plan leaves it. For each (BLOCK_N, num_warps, num_stages)
the kernel's median time, the KV bytes its walks read over it, and that over the copy rate measured
in the same run. Correctness: every setting's output equals the shipped setting's.

    PYTHONPATH=. python -m benchmarks.probes.window_tiles [--batch 256] [--len 16448] [--window 1024]
        [--skip 896]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from pathlib import Path

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--len", type=int, default=16448)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--skip", type=int, default=896, help="keys of the shared run inside each window")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--first", type=int, default=64, help="keys each row walks before the shared run")
    args = ap.parse_args()
    from benchmarks.harness.timing import bench_ms, measure_ceilings
    from prefixserve.attention.kernels import window_attention as wa
    from prefixserve.attention.metadata import build_metadata

    dev = torch.device("cuda")
    copy_tbps, _ = measure_ceilings(dev)
    b, n, w, bs, kvh, d = args.batch, args.len, args.window, 16, 8, args.dim
    blocks_per = -(-n // bs)
    pool = b * (w // bs + 8)  # each sequence's window tail in blocks of its own (enough distinct rows)
    k = torch.randn(pool + 1, bs, kvh, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    rng = np.random.default_rng(0)
    tables = rng.integers(0, pool, (b, blocks_per), dtype=np.int32)
    meta = build_metadata(bs, [1] * b, [n] * b, tables, dev)
    q = torch.randn(b, 2 * kvh, d, device=dev, dtype=torch.bfloat16)
    lo = n - w
    skip_lo = torch.full((b,), lo + args.first, dtype=torch.int32, device=dev)  # the walk before the run
    skip_hi = torch.full((b,), lo + args.first + args.skip, dtype=torch.int32, device=dev)
    walked = w - args.skip  # keys each row walks
    kv_bytes = b * walked * kvh * d * 2 * 2
    o_part = torch.empty(b, 2 * kvh, d, device=dev, dtype=torch.float32)
    lse = torch.empty(b, 2 * kvh, device=dev, dtype=torch.float32)
    walk = wa.walk_inputs(meta)
    grid, base_args, kw = wa._launch_args(q, k, v, walk, d**-0.5, w, (skip_lo, skip_hi), (o_part, lse))
    wa._window_kernel[grid](*base_args, **kw)
    want = o_part.clone()
    shipped_us = bench_ms(lambda: wa._window_kernel[grid](*base_args, **kw)) * 1e3
    rows = []
    for block_n, warps, stages in itertools.product((16, 32, 64), (2, 4, 8), (1, 2, 3, 4)):
        cfg = {**kw, "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}
        try:
            o_part.zero_()
            wa._window_kernel[grid](*base_args, **cfg)
            torch.cuda.synchronize()
        except Exception as e:  # out of shared memory / registers: not a candidate
            rows.append({"BLOCK_N": block_n, "warps": warps, "stages": stages,
                         "error": f"{type(e).__name__}: {e}"[:200]})  # fmt: skip
            continue
        ok = bool(torch.allclose(o_part, want, atol=2e-2, rtol=2e-2))
        ms = bench_ms(lambda: wa._window_kernel[grid](*base_args, **cfg))  # noqa: B023
        tbps = kv_bytes / (ms * 1e-3) / 1e12
        rows.append(
            {"BLOCK_N": block_n, "warps": warps, "stages": stages, "us": ms * 1e3,
             "TBps": tbps, "of_copy": tbps / copy_tbps, "matches": ok}
        )  # fmt: skip
    shipped = {
        "BLOCK_N": kw["BLOCK_N"],
        "warps": kw["num_warps"],
        "stages": kw["num_stages"],
        "us": shipped_us,
        "of_copy": kv_bytes / (shipped_us * 1e-6) / 1e12 / copy_tbps,
    }
    out = {"copy_TBps": copy_tbps, "settings": vars(args), "shipped": shipped, "rows": rows}
    dest = Path(os.environ.get("OUT", ".")) / "window_tiles.json"
    dest.write_text(json.dumps(out, indent=1))
    good = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
    print(f"copy {copy_tbps:.2f} TB/s; {kv_bytes / 1e6:.0f} MB walked per call; shipped {shipped}")
    print("| BLOCK_N | warps | stages | us | TB/s | of copy | matches |")
    for r in good[:16]:
        print(f"| {r['BLOCK_N']} | {r['warps']} | {r['stages']} | {r['us']:.1f} "
              f"| {r['TBps']:.2f} | {r['of_copy']:.2f} | {r['matches']} |")  # fmt: skip


if __name__ == "__main__":
    main()
