"""What a byte read from L2 costs in energy, against a byte read from HBM (the same kernel over both).

Why: the mixed kernel's shared tiles reach every SM from L2 (each prefix tile is read from HBM once
and then by every row tile of its KV head), and whole shared-heavy steps run at the board's power
cap, where joules a step set the speed (docs/kernels.md §5). One sweep kernel reads a buffer in
16 KB chunks, program p taking chunks p, p + G, ... wrapped around, so a buffer that fits L2 is read
from L2 (``.cg``: L1 is skipped) and a 2 GiB one from HBM. Each runs back to back for a window
while nvidia-smi samples the board (``benchmarks/power.py``'s sampler); a spinning kernel gives the
floor, and a byte's energy is (W - floor) / rate. Prints a table; ``--json`` keeps it.

PYTHONPATH=. python -m benchmarks.probes.l2_energy [--window 3]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from prefixserve.attention.kernels import require_triton

triton, tl = require_triton()

CHUNK = 8192  # bf16 elements a load: 16 KB


@triton.jit
def _sweep_kernel(buf_ptr, out_ptr, n_chunks, iters, CHUNK: tl.constexpr):
    """Program p sums chunks p, p + G, ... (mod n_chunks) for ``iters`` loads; one float out."""
    p = tl.program_id(0)
    g = tl.num_programs(0)
    offs = tl.arange(0, CHUNK)
    acc = tl.zeros([CHUNK], dtype=tl.float32)
    for i in range(iters):
        c = ((p + i * g) % n_chunks).to(tl.int64)
        acc += tl.load(buf_ptr + c * CHUNK + offs, cache_modifier=".cg").to(tl.float32)
    tl.store(out_ptr + p, tl.sum(acc, axis=0))


def sweep(buf: torch.Tensor, out: torch.Tensor, iters: int) -> None:
    """Read ``out.numel() * iters`` chunks of ``buf`` (the bytes: that x 16 KB)."""
    _sweep_kernel[(out.numel(),)](buf, out, buf.numel() // CHUNK, iters, CHUNK=CHUNK, num_warps=8)


def reference(buf: torch.Tensor, programs: int, iters: int) -> torch.Tensor:
    """What ``sweep`` writes, in torch."""
    chunks = buf.float().view(-1, CHUNK)
    idx = (torch.arange(programs)[:, None] + torch.arange(iters)[None, :] * programs) % chunks.shape[0]
    return chunks[idx.to(buf.device)].sum(dim=(1, 2))


def main() -> None:
    from benchmarks.power import Sampler, sustained

    ap = argparse.ArgumentParser()
    ap.add_argument("--window", type=float, default=3.0)
    ap.add_argument("--l2-mb", type=int, nargs="+", default=[8, 24])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    programs = 8 * sms
    out = torch.empty(programs, device="cuda", dtype=torch.float32)
    small = torch.randn(programs * 4 * CHUNK, device="cuda", dtype=torch.bfloat16)
    sweep(small, out, 4)
    torch.testing.assert_close(out, reference(small, programs, 4), rtol=1e-4, atol=1e-2)
    sampler = Sampler()
    time.sleep(0.5)
    rows = []
    floor = sustained(lambda: torch.cuda._sleep(1_000_000), sampler, args.window)
    rows.append({"what": "spin (floor)", **floor})
    for name, mb in [*((f"L2, {mb} MB", mb) for mb in args.l2_mb), ("HBM, 2 GiB", 2048)]:
        buf = torch.randn(mb * 2**20 // 2, device="cuda", dtype=torch.bfloat16)
        iters = 64 if mb > 256 else 512  # each launch about a millisecond
        res = sustained(lambda buf=buf, iters=iters: sweep(buf, out, iters), sampler, args.window)
        res["TBps"] = programs * iters * CHUNK * 2 / res["ms"] / 1e9
        res["pJ_per_byte"] = (res["power_w"] - floor["power_w"]) / (res["TBps"] * 1e12) * 1e12
        rows.append({"what": name, **res})
        del buf
        torch.cuda.empty_cache()
    sampler.close()
    print("| read | TB/s | board W | SM MHz (min) | pJ a byte above the floor | throttle |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        rate = f"{r['TBps']:.2f}" if "TBps" in r else "-"
        pj = f"{r['pJ_per_byte']:.1f}" if "pJ_per_byte" in r else "-"
        print(
            f"| {r['what']} | {rate} | {r['power_w']} | {r['sm_mhz']} ({r['sm_mhz_min']}) | {pj} | "
            f"{', '.join(r['reasons']) or '-'} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
