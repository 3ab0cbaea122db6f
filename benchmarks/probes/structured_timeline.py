"""Where the GPU's time goes in a constrained run against an unconstrained one (``benchmarks/structured.py``'s
workload), from a profiler timeline: is a constrained step host-bound, or does the device wait?

For each mode, one ``LLM.chat`` run of B rows is profiled (CUDA kernels only, after an untimed run):
the run's wall time, the device's busy time (the union of its kernels), the idle rest, and the
kernels by name (count, total, median). A gated step's spin on the grammar fill is inside
``flagged_chunk_argmax`` (greedy rows) or ``wait_for_fill``: their time beyond the plain argmax's is
the device waiting for the matcher process.

PYTHONPATH=. python -m benchmarks.probes.structured_timeline --model dummy:DIR [--batch 64] [--tokens 64]
    [--out FILE.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness.output import write_json
from benchmarks.structured import SCHEMA, _conversations


def _union(spans: list[tuple[float, float]]) -> float:
    """Total length covered by the (start, end) spans."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def profile_run(llm: Any, convs: list[Any], params: Any) -> dict[str, Any]:
    """One profiled run: wall, device busy, kernels by name (us)."""
    from torch.profiler import ProfilerActivity, profile

    llm.chat(convs, params)  # untimed
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        llm.chat(convs, params)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    spans = [(e.time_range.start, e.time_range.end) for e in kernels]
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in kernels:
        by_name[e.name[:60]].append(e.time_range.end - e.time_range.start)
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:14]
    return {
        "wall_ms": wall * 1e3,
        "busy_ms": _union(spans) / 1e3,
        "first_to_last_ms": (max(b for _, b in spans) - min(a for a, _ in spans)) / 1e3 if spans else 0.0,
        "kernels": {
            name: {"count": len(d), "total_ms": sum(d) / 1e3, "median_us": statistics.median(d)}
            for name, d in top
        },
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from prefixserve import LLM, SamplingParams, StructuredOutputs

    llm = LLM(
        model=args.model, device="cuda", dtype="bfloat16", max_num_seqs=max(args.batch, 8),
        enable_prefix_caching=False, progress=False,
    )  # fmt: skip
    convs = _conversations(args.batch)
    modes = {
        "unconstrained": SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True),
        "json_schema": SamplingParams(
            temperature=0.0, max_tokens=args.tokens, structured_outputs=StructuredOutputs(json=SCHEMA)
        ),
    }
    result = {"settings": vars(args) | {"commit": os.environ.get("PREFIXSERVE_COMMIT")}, "modes": {}}
    for name, params in modes.items():
        run = result["modes"][name] = profile_run(llm, convs, params)
        print(
            f"\n{name}: wall {run['wall_ms']:.1f} ms, device busy {run['busy_ms']:.1f} ms "
            f"(first to last kernel {run['first_to_last_ms']:.1f} ms)"
        )
        for kname, k in run["kernels"].items():
            print(f"  {k['count']:5d} x {k['median_us']:7.1f} us = {k['total_ms']:7.2f} ms  {kname}")
    if args.out:
        write_json(Path(args.out), result, indent=1)


if __name__ == "__main__":
    main()
