"""Where a decode step's time goes (tensor-parallel or one GPU): rank 0's kernels per step, by kind.

One engine per process (only a process's first tensor-parallel engine gets the peer all-reduce), the
8B-shaped dummy model, B requests sharing a P-token prefix, decode steps under CUDA graphs as served.
After a warm-up run of the same shapes, ``torch.profiler`` records a short run; kernel device time
is summed by name, divided by the decode steps, and grouped (matmul, attention, all-reduce, norm,
elementwise, sampling, copy, other). Run it once per rank count and compare the two JSON files.

PYTHONPATH=. python -m benchmarks.probes.tp_step_profile --tp 2 --json out/tp2.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.decode_run import add_shared_run_args, decode_ms_per_step, shared_prompts
from benchmarks.harness.info import git_commit
from prefixserve import LLM, SamplingParams

KINDS = (  # first match wins: (kind, substrings of a kernel's name, lower case)
    ("allreduce", ("allreduce", "all_reduce", "nccl", "two_shot", "symm", "barrier", "peer_add")),
    ("attention", ("attn", "attention", "cascade", "merge", "flash", "shared_", "own_", "decode_", "paged")),
    ("matmul", ("gemm", "nvjet", "sm90_xmma", "cutlass", "matmul", "gate_up", "skinny", "_fp8_kernel")),
    ("norm", ("rms", "norm")),
    ("sampling", ("argmax", "softmax", "sample", "topk", "sort", "penalt")),
    ("copy", ("copy", "memcpy", "memset", "cat", "index")),
    ("elementwise", ("elementwise", "silu", "rotary", "rope", "mul", "add", "fill", "quantize")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    return next((k for k, subs in KINDS if any(s in low for s in subs)), "other")


def _gap_pairs(prof: profile) -> dict[str, tuple[float, int]]:
    """Microseconds and count of the GPU's gaps (no kernel, copy or memset running on rank 0's
    device) by the names of the activity before and after each, over one profiled run."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as trace_file:
            trace = json.load(trace_file)
    spans = sorted(
        (ev["ts"], ev["ts"] + ev.get("dur", 0), ev["name"][:60])
        for ev in trace.get("traceEvents", [])
        if ev.get("ph") == "X" and ev.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    )
    gaps: dict[str, tuple[float, int]] = {}
    end, before = None, ""
    for start, stop, name in spans:
        if end is not None and start > end:
            key = f"{before} -> {name}"
            old = gaps.get(key, (0.0, 0))
            gaps[key] = (old[0] + start - end, old[1] + 1)
        if end is None or stop > end:
            end, before = stop, name
    return gaps


def _profiled(llm: LLM, args: argparse.Namespace, gen: int, seed: int) -> tuple[dict, float, dict]:
    """Kernel device microseconds and calls by name over one run; its decode ms per step; its gaps."""
    params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    prompts = shared_prompts(args.batch, args.prefix, args.own, seed=seed)
    torch.cuda.synchronize()
    activities = [ProfilerActivity.CUDA] if args.cuda_only else [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=activities) as prof:
        outs = llm.generate(prompts, params)
        torch.cuda.synchronize()
    by_name: dict[str, tuple[float, int]] = {}
    for ev in prof.key_averages():
        us = getattr(ev, "self_device_time_total", 0.0) or getattr(ev, "self_cuda_time_total", 0.0)
        if us > 0 and ev.device_type == torch.autograd.DeviceType.CUDA:
            old = by_name.get(ev.key, (0.0, 0))
            by_name[ev.key] = (old[0] + us, old[1] + ev.count)
    return by_name, decode_ms_per_step(outs, gen), _gap_pairs(prof)


def _per_step(long: dict, short: dict, steps: int) -> dict[str, tuple[float, float]]:
    """What the long run has beyond the short one (its extra decode steps), per decode step."""
    out = {
        n: (
            (long[n][0] - short.get(n, (0.0, 0))[0]) / steps,
            (long[n][1] - short.get(n, (0.0, 0))[1]) / steps,
        )
        for n in long
    }
    return {n: v for n, v in out.items() if v[0] > 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shared_run_args(ap, gen=40, short_gen=8)
    ap.add_argument("--max-batched-tokens", type=int, default=16384, help="smaller keeps more KV (70B)")
    ap.add_argument("--no-peer", action="store_true", help="every all-reduce through NCCL")
    ap.add_argument("--cuda-only", action="store_true", help="record GPU activity alone (less host overhead)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--keep-sliding-kv", action="store_true", help="every layer's KV kept (kv/layout.py)")
    ap.add_argument("--quantization", default=None, choices=[None, "fp8"], help="FP8 weights (issue 103)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    ap.add_argument("--attention", default="auto", help="'none': the ceiling step without attention")
    args = ap.parse_args()

    llm = LLM(
        model=args.model,
        tensor_parallel_size=args.tp,
        tp_peer_allreduce=not args.no_peer,
        dtype="bfloat16",
        device="cuda",
        max_num_seqs=args.batch,
        max_num_batched_tokens=args.max_batched_tokens,
        progress=False,
        keep_sliding_kv=args.keep_sliding_kv,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        attention=args.attention,
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.gen, ignore_eos=True)
    llm.generate(shared_prompts(args.batch, args.prefix, args.own, seed=1), params)  # warm: graphs, compiles
    # two profiled runs of the same shapes, short and long: their difference is decode steps alone
    short, _, short_gaps = _profiled(llm, args, args.short_gen, seed=2)
    runner = llm.engine.runner
    if args.tp > 1:
        runner.worker_stats()  # from here: the long run's steps
    idle_before = dict(runner.timers)
    long, long_ms, long_gaps = _profiled(llm, args, args.gen, seed=3)
    workers = runner.worker_stats() if args.tp > 1 else []
    keys = ("gpu_busy_seconds_total", "gpu_idle_seconds_total")
    rank0 = {k: runner.timers[k] - idle_before.get(k, 0.0) for k in keys}
    steps = args.gen - args.short_gen
    by_name = _per_step(long, short, steps)
    gaps = _per_step(long_gaps, short_gaps, steps)
    total_us = sum(v[0] for v in by_name.values())
    by_kind: dict[str, float] = defaultdict(float)
    for name, (us, _) in by_name.items():
        by_kind[kind_of(name)] += us
    result = {
        "tp": args.tp,
        "peer": not args.no_peer,
        "keep_sliding_kv": args.keep_sliding_kv,
        "batch": args.batch,
        "prefix": args.prefix,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "attention": args.attention,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "decode_ms_per_step": long_ms,  # the long run's first token to last finish, per decode step
        "kernel_ms_per_step": total_us / 1e3,
        # each rank's GPU idle between its steps over the long run (rank 0: the engine's timer)
        "gpu_idle_frac_by_rank": [
            rank0["gpu_idle_seconds_total"] / max(1e-9, sum(rank0.values())),
            *(w["gpu_idle_s"] / max(1e-9, w["gpu_idle_s"] + w["gpu_busy_s"]) for w in workers),
        ],
        "gap_ms_per_step": sum(v[0] for v in gaps.values()) / 1e3,
        "top_gaps": [
            {"between": n, "ms": us / 1e3, "per_step": c}
            for n, (us, c) in sorted(gaps.items(), key=lambda kv: -kv[1][0])[:25]
        ],
        "kinds_ms_per_step": {k: v / 1e3 for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "top": [
            {"name": n[:120], "ms": us / 1e3, "calls_per_step": c, "kind": kind_of(n)}
            for n, (us, c) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:40]
        ],
    }
    llm.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(
        f"TP={args.tp} peer={not args.no_peer} decode "
        f"{result['decode_ms_per_step']:.2f} ms/step, kernels {total_us / 1e3:.2f} ms/step, GPU idle by rank "
        + " / ".join(f"{x:.1%}" for x in result["gpu_idle_frac_by_rank"])
    )
    for k, ms in result["kinds_ms_per_step"].items():
        print(f"  {k:12s} {ms:8.2f} ms  ({ms / max(total_us / 1e3, 1e-9):.0%})")
    for row in result["top"][:25]:
        print(f"  {row['ms']:8.3f} ms {row['calls_per_step']:6.1f}x {row['kind']:10s} {row['name'][:90]}")
    print(f"gaps between GPU activities: {result['gap_ms_per_step']:.3f} ms/step")
    for row in result["top_gaps"][:12]:
        print(f"  {row['ms']:8.3f} ms {row['per_step']:6.1f}x  {row['between'][:110]}")


if __name__ == "__main__":
    main()
