"""What a byte read costs from L2 against HBM, at the board's power: the premise of 192-row shared tiles.

One Triton kernel reads an N-MB bf16 buffer R times (R x N about 1.6 GB a launch, four programs an
SM summing into registers), back to back for a few seconds with the board sampled (``benchmarks.power``);
energy a byte is the power above the spin kernel's floor over the read rate. Buffers that fit the
L2 (50 MB on an H100/H200, in two halves) read from it; larger ones from HBM. A shared-kernel program
reads its segment's K and V from L2 once for its query rows, so rows per program set those reads
(docs/kernels.md §2.3: 192-row tiles).

PYTHONPATH=. python -m benchmarks.probes.l2_energy --sizes-mb 8 16 24 32 64 2048
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.harness.info import run_info
from prefixserve.triton_support import require_triton

triton, tl = require_triton()


@triton.jit
def _reread(x_ptr, out_ptr, n, reps, BLOCK: tl.constexpr):
    """Each program sums its strided blocks of x, ``reps`` times over; one partial sum a lane out."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    acc = tl.zeros([BLOCK], tl.float32)
    for _ in range(reps):
        for start in range(pid * BLOCK, n, step):
            offs = start + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid * BLOCK + tl.arange(0, BLOCK), acc)


@triton.jit
def _group_read(x_ptr, out_ptr, n_slice, READERS: tl.constexpr, BLOCK: tl.constexpr):
    """Programs in groups of ``READERS`` each read their group's slice of x once, front to back, all
    the same addresses in the same order: the first reader of a line pays HBM, the others hit L2 while
    the group keeps together (the shared kernel's row tiles over one segment chunk)."""
    pid = tl.program_id(0)
    base = (pid // READERS).to(tl.int64) * n_slice
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_slice, BLOCK):
        acc += tl.load(x_ptr + base + start + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out_ptr + pid * BLOCK + tl.arange(0, BLOCK), acc)


def measure_readers(readers: int, mb: int, sampler, seconds: float, floor_w: float) -> dict:
    """Energy a byte of an ``mb``-MB buffer read once from HBM and ``readers - 1`` more times from L2
    by groups reading in step; ``pJ_per_line_byte`` is per byte of the buffer (all its reads)."""
    from benchmarks import power

    block = 4096
    grid = torch.cuda.get_device_properties(0).multi_processor_count * 4 // readers * readers
    n_slice = mb * 2**20 // 2 // (grid // readers) // block * block
    x = torch.randn(n_slice * (grid // readers), device="cuda", dtype=torch.bfloat16)
    out = torch.empty(grid * block, device="cuda", dtype=torch.float32)

    def fn() -> None:
        _group_read[(grid,)](x, out, n_slice, READERS=readers, BLOCK=block, num_warps=8)

    fn()
    torch.cuda.synchronize()
    st = power.sustained(fn, sampler, seconds)
    line_tbps = 2 * x.numel() / (st["ms"] * 1e-3) / 1e12  # buffer bytes a second, each read `readers` times
    pj = (st["power_w"] - floor_w) / line_tbps
    return {
        "readers": readers,
        "MB": mb,
        "ms": st["ms"],
        "W": st["power_w"],
        "sm_mhz": st["sm_mhz"],
        "line_TBps": line_tbps,
        "pJ_per_line_byte": pj,
    }


def measure(mb: int, sampler, seconds: float, floor_w: float) -> dict:
    """Read rate and energy a byte above the floor for an ``mb``-MB buffer."""
    from benchmarks import power

    n = mb * 2**20 // 2
    reps = max(1, 1600 // mb)
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    block, grid = 4096, torch.cuda.get_device_properties(0).multi_processor_count * 4
    out = torch.empty(grid * block, device="cuda", dtype=torch.float32)

    def fn() -> None:
        _reread[(grid,)](x, out, n, reps, BLOCK=block, num_warps=8)

    fn()
    torch.cuda.synchronize()
    st = power.sustained(fn, sampler, seconds)
    tbps = 2 * n * reps / (st["ms"] * 1e-3) / 1e12
    pj = (st["power_w"] - floor_w) / tbps
    return {"MB": mb, "TBps": tbps, "W": st["power_w"], "sm_mhz": st["sm_mhz"], "pJ_per_byte": pj}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes-mb", nargs="+", type=int, default=[8, 16, 24, 32, 40, 64, 256, 2048])
    ap.add_argument("--seconds", type=float, default=2.5)
    ap.add_argument(
        "--readers",
        nargs="*",
        type=int,
        default=[],
        help="also a 2 GB buffer read by groups of R programs in step (1 = HBM alone): L2's cost a "
        "byte read by the other R - 1, when a group keeps together",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from benchmarks import power

    sampler = power.Sampler(gpu="0")
    floor_w = power.spin_floor_w(sampler, 2.0)
    rows = [measure(mb, sampler, args.seconds, floor_w) for mb in args.sizes_mb]
    groups = [measure_readers(r, 2048, sampler, args.seconds, floor_w) for r in args.readers]
    sampler.close()
    print(f"{torch.cuda.get_device_name()}: spin floor {floor_w:.0f} W")
    print("| MB | TB/s | W | SM MHz | pJ a byte above the floor |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['MB']} | {r['TBps']:.2f} | {r['W']:.0f} | {r['sm_mhz']} | {r['pJ_per_byte']:.1f} |")
    if groups:
        alone = next((g["pJ_per_line_byte"] for g in groups if g["readers"] == 1), None)
        print("\n| readers | ms a launch | W | SM MHz | pJ a buffer byte | pJ a byte of each later read |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: |")
        for g in groups:
            later = (
                "-"
                if alone is None or g["readers"] == 1
                else f"{(g['pJ_per_line_byte'] - alone) / (g['readers'] - 1):.1f}"
            )
            print(
                f"| {g['readers']} | {g['ms']:.2f} | {g['W']:.0f} | {g['sm_mhz']} "
                f"| {g['pJ_per_line_byte']:.1f} | {later} |"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(run_info() | {"floor_w": floor_w, "rows": rows, "groups": groups}, f, indent=1)


if __name__ == "__main__":
    main()
