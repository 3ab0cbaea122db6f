"""Greedy argmax over a decode step's logits: ``torch.argmax`` against ``sampling/argmax.py``'s kernels.

[B, 128,256] logits in the model dtype (bf16, as the engine's all-greedy steps hand them over), each
way timed as one CUDA graph of 20 calls over 8 logits copies (so most reads miss L2), median of 5
replays; the two ways alternate ``--rounds`` times. Checks exact equality first.

PYTHONPATH=. python -m benchmarks.probes.argmax_rate --batches 1 16 64 256 1024
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch

from benchmarks.harness.timing import graph_ms
from prefixserve.sampling.argmax import argmax_rows, kernel_argmax

VOCAB = 128_256


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64, 256, 1024])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--sweep", action="store_true", help="also time block x warps x programs a multiprocessor"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for b in args.batches:
        xs = [torch.randn(b, VOCAB, device="cuda", dtype=torch.bfloat16) for _ in range(8)]
        assert all(torch.equal(argmax_rows(x), x.argmax(-1)) for x in xs), f"B={b}: kernels differ from torch"
        torch_ms, kernel_ms = [], []
        for _ in range(args.rounds):
            torch_ms.append(graph_ms(lambda i, xs=xs: xs[i].argmax(-1), len(xs)))
            kernel_ms.append(graph_ms(lambda i, xs=xs: argmax_rows(xs[i]), len(xs)))
        t, k = sorted(torch_ms)[args.rounds // 2], sorted(kernel_ms)[args.rounds // 2]
        gbytes = b * VOCAB * 2 / 1e9
        host = {
            name: host_us(fn, xs[0])
            for name, fn in (("torch", lambda x: x.argmax(-1)), ("kernels", argmax_rows))
        }
        rows.append({"B": b, "torch_us": t * 1e3, "kernel_us": k * 1e3, "GB": gbytes, "host_us": host})
        print(f"    host per call: torch {host['torch']:.1f} us, kernels {host['kernels']:.1f} us")
        if args.sweep:
            rows[-1]["sweep"] = sweep(xs)
        print(f"| {b} | torch {t * 1e3:.1f} us ({gbytes / t:.2f} TB/s) | kernels {k * 1e3:.1f} us "
              f"({gbytes / k:.2f} TB/s) | torch / kernels {t / k:.2f} |", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


def host_us(fn, x: torch.Tensor, calls: int = 200) -> float:
    """Host microseconds per call, the GPU kept busy so that no launch waits for it."""
    fn(x)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # a few hundred ms of GPU time ahead of the launches
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(x)
    t = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return t


def sweep(xs: list[torch.Tensor]) -> list[dict]:
    """Each launch shape's time on these logits; prints the best three."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = []
    for block, warps, per_sm in itertools.product((512, 1024, 2048, 4096), (4, 8), (2, 4, 8, 16)):
        if block < 32 * warps:
            continue

        def run(i, block=block, warps=warps, per_sm=per_sm):
            return kernel_argmax(xs[i], per_sm * sms, block, warps)

        assert torch.equal(run(0), xs[0].argmax(-1))
        out.append({"block": block, "warps": warps, "per_sm": per_sm, "us": graph_ms(run, len(xs)) * 1e3})
    for r in sorted(out, key=lambda r: r["us"])[:3]:
        print(f"    block {r['block']} warps {r['warps']} per SM {r['per_sm']}: {r['us']:.1f} us")
    return out


if __name__ == "__main__":
    main()
