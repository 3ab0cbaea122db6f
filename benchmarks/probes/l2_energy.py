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
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from benchmarks import power

    sampler = power.Sampler(gpu="0")
    floor_w = power.sustained(lambda: torch.cuda._sleep(1_000_000), sampler, 2.0)["power_w"]
    rows = [measure(mb, sampler, args.seconds, floor_w) for mb in args.sizes_mb]
    sampler.close()
    print(f"{torch.cuda.get_device_name()}: spin floor {floor_w:.0f} W")
    print("| MB | TB/s | W | SM MHz | pJ a byte above the floor |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['MB']} | {r['TBps']:.2f} | {r['W']:.0f} | {r['sm_mhz']} | {r['pJ_per_byte']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(run_info() | {"floor_w": floor_w, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
