"""How fast the own part of a shared-prefix decode step runs, per launch shape, against its bytes.

The own part: each sequence's own KV (``--own`` tokens on average, lengths drawn from [own/2,
3 own/2], scattered blocks as a decode allocates them) attended by the paged kernel into fp32
partials, one launch (graphed, L2 flushed). Variants: KV splits, BLOCK_N, stages, warps, sequences
per program. Also the CSR merge of a step's partials per row. Prints tables; ``--json`` keeps them.
``--heads 32/4`` sets query / KV heads (the 70B's TP=2 shard); ``--sustained S`` also runs each
launch back to back for S seconds with the board's power and ranks them by millijoules a call above
the spin kernel's floor: at the power cap that, not a burst's time, is what a step pays. Each batch
also times the own KV read alone, the same paged walk with no products (``_paged_read``): the floor
an own kernel of this layout could reach.

PYTHONPATH=. python -m benchmarks.probes.own_part --batches 64 256 1024
PYTHONPATH=. python -m benchmarks.probes.own_part --heads 32/4 --batches 256 --sustained 1
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.harness.timing import bench_ms, graphed, measure_ceilings
from prefixserve.attention.kernels import merge, paged_attention
from prefixserve.triton_support import require_triton

HQ, HKV, D, BS = 32, 8, 128, 16
triton, tl = require_triton()


@triton.jit
def _paged_read(
    k_ptr,
    v_ptr,
    bt_ptr,
    lens_ptr,
    out_ptr,
    stride_kb,
    stride_kt,
    stride_bt,
    HKV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    STAGES: tl.constexpr,
):
    """One (sequence, KV head): its own K and V rows read through the block table and summed (so
    that nothing is optimised away), the paged kernel's walk without its products."""
    pid = tl.program_id(0)
    seq, kvh = pid // HKV, pid % HKV
    n = tl.load(lens_ptr + seq)
    offs_d = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for start in tl.range(0, n, BLOCK_N, num_stages=STAGES):
        offs = start + tl.arange(0, BLOCK_N)
        ok = offs < n
        blk = tl.load(bt_ptr + seq * stride_bt + offs // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
        rows = blk * stride_kb + (offs % BLOCK_SIZE) * stride_kt + kvh * HEAD_DIM
        k = tl.load(k_ptr + rows[:, None] + offs_d[None, :], mask=ok[:, None], other=0.0)
        v = tl.load(v_ptr + rows[:, None] + offs_d[None, :], mask=ok[:, None], other=0.0)
        acc += k.to(tl.float32) + v.to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(tl.sum(acc, 1), 0))


def read_launch(c: dict, block_n: int = 64, stages: int = 3) -> Callable[[], None]:
    """The own KV read alone (``_paged_read``), run once, graphed."""
    b, hkv = c["q"].shape[0], c["k"].shape[2]
    out = torch.empty(b * hkv, dtype=torch.float32, device="cuda")
    k, v, tables = c["k"], c["v"], c["tables"]

    def run() -> None:
        _paged_read[(b * hkv,)](
            k,
            v,
            tables,
            c["lens"],
            out,
            k.stride(0),
            k.stride(1),
            tables.stride(0),
            hkv,
            D,
            block_n,
            BS,
            stages,
        )

    run()
    return graphed(run)


def own_case(batch: int, own: int, seed: int = 0, heads: tuple[int, int] = (HQ, HKV)) -> dict:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(own // 2, own + own // 2 + 1, (batch,), generator=g)
    width = -(-int(lens.max()) // BS)
    blocks = batch * width + 16
    perm = torch.randperm(blocks, generator=g)[: batch * width].view(batch, width).to(torch.int32)
    dev = "cuda"
    hq, hkv = heads
    return {
        "q": torch.randn(batch, hq, D, device=dev, dtype=torch.bfloat16),
        "k": torch.randn(blocks, BS, hkv, D, device=dev, dtype=torch.bfloat16),
        "v": torch.randn(blocks, BS, hkv, D, device=dev, dtype=torch.bfloat16),
        "tables": perm.to(dev),
        "lens": lens.to(torch.int32).to(dev),
        "qsl": torch.arange(batch + 1, dtype=torch.int32, device=dev),
        "bytes": int(lens.sum()) * hkv * D * 2 * 2,
        "max": int(lens.max()),
    }


def own_launch(c: dict, splits: int, block_n: int, stages: int, warps: int, pack: int) -> Callable[[], None]:
    """One own-part launch of ``c`` at this shape, run once (compiled), graphed."""
    b, hq = c["q"].shape[:2]
    split_size = math.ceil(math.ceil(c["max"] / splits) / block_n) * block_n
    splits = math.ceil(c["max"] / split_size)
    o = torch.empty(splits * b, hq, D, dtype=torch.float32, device="cuda")
    lse = torch.empty(splits * b, hq, dtype=torch.float32, device="cuda")

    def run() -> None:
        paged_attention.launch_paged(
            c["q"],
            c["k"],
            c["v"],
            c["tables"],
            c["lens"],
            c["qsl"],
            0.088,
            1,
            splits,
            split_size,
            o,
            lse,
            b * hq * D,
            b * hq,
            block_n,
            num_warps=warps,
            num_stages=stages,
            pack=pack,
        )

    run()
    return graphed(run)


def timed(fn: Callable[[], None], sampler: Any, floor_w: float, seconds: float) -> dict:
    """A launch's burst time (L2 flushed) and, given a sampler, its run back to back with power."""
    row = {"ms": bench_ms(fn)}
    if sampler is not None:
        from benchmarks import power

        b2b = power.back_to_back(fn, sampler, seconds, floor_w)
        row |= {"sustained_us": b2b["us"], "power_w": b2b["power_w"], "mJ_above_floor": b2b["mj_above_floor"]}
    return row


def energy_text(r: dict) -> str:
    """The back-to-back part of a printed row, or nothing where it was not run."""
    if "mJ_above_floor" not in r:
        return ""
    return (
        f"; back to back {r['sustained_us']:.1f} us at {r['power_w']:.0f} W, "
        f"{r['mJ_above_floor']:.2f} mJ above the floor"
    )


def time_merge(rows: int, parts: int) -> float:
    o = torch.randn(rows * parts, HQ, D, device="cuda")
    lse = torch.randn(rows * parts, HQ, device="cuda")
    out = torch.empty(rows, HQ, D, device="cuda", dtype=torch.bfloat16)
    row_ptr = torch.arange(0, rows * parts + 1, parts, dtype=torch.int32, device="cuda")
    idx = (
        torch.arange(rows * parts, dtype=torch.int32, device="cuda")
        .view(parts, rows)
        .t()
        .contiguous()
        .view(-1)
    )

    def run() -> None:
        merge.merge_partials(o, lse, rows, row_ptr=row_ptr, part_idx=idx, out=out, want_lse=False)

    run()
    return bench_ms(graphed(run))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--own", type=int, default=128)
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--block-n", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--warps", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--pack", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--merge-parts", type=int, nargs="+", default=[2, 3, 5, 9, 12])
    ap.add_argument("--skip-own", action="store_true")
    ap.add_argument("--heads", default=f"{HQ}/{HKV}", help="query / KV heads, e.g. 32/4")
    ap.add_argument("--sustained", type=float, default=0.0, help="also S seconds back to back, with power")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    heads = tuple(int(x) for x in args.heads.split("/"))
    copy_tbps, _ = measure_ceilings(torch.device("cuda"))
    print(f"copy {copy_tbps:.2f} TB/s")
    from benchmarks.harness.info import run_info

    out = run_info() | {"copy_tbps": copy_tbps, "heads": args.heads, "own": [], "merge": []}
    sampler, floor_w = None, 0.0
    if args.sustained:
        from benchmarks import power

        sampler = power.Sampler(gpu="0")
        floor_w = power.spin_floor_w(sampler)
        out["floor_w"] = floor_w
        print(f"spin floor {floor_w:.0f} W")
    for b in args.batches:
        c = own_case(b, args.own, heads=heads)
        bound = c["bytes"] / (copy_tbps * 1e12) * 1e3
        rows = []
        for s, n, st, w, p in (
            ()
            if args.skip_own
            else itertools.product(args.splits, args.block_n, args.stages, args.warps, args.pack)
        ):
            try:
                fn = own_launch(c, s, n, st, w, p)
            except Exception as e:  # a shape the kernel cannot take
                print(f"B={b} splits={s} n={n} stages={st} warps={w} pack={p}: {type(e).__name__}")
                continue
            row = {"B": b, "splits": s, "block_n": n, "stages": st, "warps": w, "pack": p}
            rows.append(row | timed(fn, sampler, floor_w, args.sustained) | {"bound_ms": bound})
        rows.sort(key=lambda r: r["mJ_above_floor"] if sampler is not None else r["ms"])
        read = {"B": b} | timed(read_launch(c), sampler, floor_w, args.sustained)
        out.setdefault("read_floor", []).append(read)
        default = next(
            (
                r
                for r in rows
                if (r["splits"], r["block_n"], r["stages"], r["warps"], r["pack"]) == (1, 64, 2, 4, 1)
            ),
            None,
        )
        print(
            f"B={b}, own {c['bytes'] / 1e6:.1f} MB, bound {bound * 1e3:.1f} us; "
            f"default {default and round(default['ms'] * 1e3, 1)} us; best 8:"
        )
        for r in rows[:8] + ([default] if default and default not in rows[:8] else []):
            print(
                f"  splits {r['splits']} n {r['block_n']} stages {r['stages']} warps {r['warps']} "
                f"pack {r['pack']}: {r['ms'] * 1e3:.1f} us ({bound / r['ms']:.0%} of copy){energy_text(r)}"
            )
        share = f"{bound / read['ms']:.0%} of copy"
        print(f"  the own KV read alone: {read['ms'] * 1e3:.1f} us ({share}){energy_text(read)}")
        out["own"] += rows
        for parts in args.merge_parts:
            ms = time_merge(b, parts)
            out["merge"].append({"B": b, "parts": parts, "ms": ms})
            print(f"  merge {b} rows x {parts} parts: {ms * 1e3:.1f} us")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    if sampler is not None:
        sampler.close()


if __name__ == "__main__":
    main()
