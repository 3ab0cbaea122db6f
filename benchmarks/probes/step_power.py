"""Do whole decode steps run at the board's power cap? Power and clocks while the engine decodes.

For each ``--points`` B x P (as ``benchmarks/throughput.py`` runs them: B prompts sharing a P-token
prefix, 64 own tokens, 128 generated, greedy, decode under CUDA graphs; P = 0 means
``attention="none"``, the dense path alone), ``nvidia-smi`` is sampled every 20 ms beside the timed
decode (``benchmarks/power.py``'s sampler), and the decode window's median power, SM clock, lowest
clock and throttle reasons are printed beside tok/s. A GEMM and a copy back to back give the board's
clock at the cap and at full speed for comparison. Prints a table; ``--json`` keeps it.

PYTHONPATH=. python -m benchmarks.probes.step_power --points 256x16384 1024x16384 256x0
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from benchmarks.power import Sampler, _copy_rate, _gemm_rate
from benchmarks.throughput import _prompts
from prefixserve import LLM, SamplingParams

OWN, GEN = 64, 128


def decode_point(batch: int, prefix: int, sampler: Sampler) -> dict:
    """tok/s of one timed decode (after a warm-up of the same shape) and the board's state during it."""
    llm = LLM(
        model="dummy:llama-3.1-8b",
        dtype="bfloat16",
        device="cuda",
        attention="auto" if prefix else "none",
        max_num_seqs=batch,
        max_num_batched_tokens=16384,
        progress=False,
    )
    params = SamplingParams(temperature=0.0, max_tokens=GEN, ignore_eos=True)
    llm.generate(_prompts(batch, prefix, OWN, seed=1), params)
    offset = time.time() - time.monotonic()  # the outputs' times are monotonic, the sampler's wall
    outs = llm.generate(_prompts(batch, prefix, OWN), params)
    first = max(o.metrics["first_token_time"] for o in outs) + offset
    last = max(o.metrics["finish_time"] for o in outs) + offset
    tokens = sum(len(c.token_ids) - 1 for o in outs for c in o.outputs)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return {"B": batch, "P": prefix, "tok_s": tokens / (last - first), **sampler.window(first + 0.1, last)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", nargs="+", default=["256x16384", "1024x16384", "256x0"])
    ap.add_argument("--window", type=float, default=3.0, help="seconds of each back-to-back ceiling")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sampler = Sampler()
    try:
        rows = {"gemm": _gemm_rate(sampler, args.window), "copy": _copy_rate(sampler, args.window)}
        for name in ("gemm", "copy"):
            r = rows[name]
            clocks = f"{r['sm_mhz']} MHz (min {r['sm_mhz_min']})"
            print(f"{name} back to back: {r['power_w']} W, {clocks}, {r['reasons']}")
        torch.cuda.empty_cache()  # the copy's buffers: the engines size their KV pools from free memory
        points = []
        for point in args.points:
            b, p = (int(x) for x in point.split("x"))
            r = decode_point(b, p, sampler)
            points.append(r)
            print(
                f"| {b} x {p} | {r['tok_s']:.0f} tok/s | {r['power_w']} W of {r['limit_w']} | "
                f"{r['sm_mhz']} MHz (min {r['sm_mhz_min']}) | {', '.join(r['reasons']) or '-'} | "
                f"{r['samples']} samples |",
                flush=True,
            )
    finally:
        sampler.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ceilings": rows, "points": points}, f, indent=1)


if __name__ == "__main__":
    main()
