"""Where a decode step's GPU time goes, kernel by kernel (torch profiler over graphed decode steps).

Two workloads: ``prefix`` (``--batch`` prompts sharing one ``--prefix``-token run, as throughput.py)
and ``module`` (``--batch`` PML prompts each importing ``--imported`` of ``--modules`` 512-token
modules, as promptcache.py's decode section). Prefill and one warm-up round run outside the profile;
then ``--steps`` decode steps run inside it. Prints GPU time per step by kernel, grouped.

PYTHONPATH=. python -m benchmarks.probes.kernel_profile --workload module --imported 10 --modules 12
PYTHONPATH=. python -m benchmarks.probes.kernel_profile --workload prefix --batch 256 --prefix 16384
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import pstats
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks._common import gpu_idle_frac
from benchmarks.promptcache import bench_schema, prompts_for
from benchmarks.throughput import _prompts
from prefixserve import LLM, SamplingParams

GROUPS = (  # kernel name fragment -> group, first match wins
    ("mixed", "attention: mixed"),
    ("shared", "attention: shared"),
    ("paged", "attention: own/paged"),
    ("merge", "attention: merge"),
    ("attend", "attention: other"),
    ("gemm", "matmul"),
    ("gemv", "matmul"),
    ("nvjet", "matmul"),
    ("cutlass", "matmul"),
    ("splitk", "matmul"),
    ("rms", "rmsnorm"),
    ("rope", "rope/kv write"),
    ("silu", "silu*mul"),
    ("argmax", "sampling"),
    ("sample", "sampling"),
    ("copy", "copies"),
    ("index", "index/scatter"),
    ("scatter", "index/scatter"),
)


def group_of(name: str) -> str:
    low = name.lower()
    for frag, group in GROUPS:
        if frag in low:
            return group
    return "other"


def busy_and_idle(spans: list[tuple[float, float]]) -> tuple[float, float]:
    """(time some kernel ran, time none did) between the first kernel's start and the last one's end."""
    busy = idle = 0.0
    end = None
    for a, b in sorted(spans):
        if end is not None and a > end:
            idle += a - end
        if end is None or b > end:
            busy += b - max(a, end) if end is not None else b - a
            end = b
    return busy, idle


def requests(llm: LLM, args: argparse.Namespace) -> list:
    if args.workload == "prefix":
        return _prompts(args.batch, args.prefix, args.own)
    schema, texts = bench_schema(llm.get_tokenizer(), args.modules, 512, 7)
    llm.register_schema(schema)
    rng = random.Random(2)
    question = " " + " ".join(["Which", "word", "came", "first", "in", "the", "notes", "above?"] * 4)
    return [prompts_for(rng, texts, args.imported, question)[0] for _ in range(args.batch)]


TMA_STEPS = collections.Counter()  # work lists planned: TMA (every segment contiguous) or pointer loads


def count_tma() -> None:
    """Wrap the graph path's work planner to count steps whose segments all allow TMA tiles."""
    from prefixserve.attention.kernels import shared_plan

    plan = shared_plan.plan_work_for

    def counted(*a, **kw):
        work = plan(*a, **kw)
        TMA_STEPS["tma" if work.tma else "pointer"] += 1
        return work

    shared_plan.plan_work_for = counted  # step_plan imports it at each call


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", choices=("prefix", "module"), default="module")
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prefix", type=int, default=16384)
    ap.add_argument("--own", type=int, default=64)
    ap.add_argument("--imported", type=int, default=6)
    ap.add_argument("--modules", type=int, default=8)
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--recovery", default="link:64", help="module_recompute for the module workload")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy, as throughput.py")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", default=None, help="write the per-kernel table here")
    ap.add_argument("--host", action="store_true", help="cProfile the host over the steps instead")
    ap.add_argument("--callees", nargs="*", default=[], help="with --host: what these functions call")
    args = ap.parse_args()
    model = None if args.model == "default" else args.model
    extra = {"kv_memory_fraction": 0.6} if torch.cuda.is_available() else {}
    llm = LLM(model, attention=args.attention, module_recompute=args.recovery,
              max_num_seqs=max(args.batch, 8), max_num_batched_tokens=16384, progress=False, **extra)
    count_tma()
    prompts = requests(llm, args)
    warm = SamplingParams(temperature=args.temperature, max_tokens=2 * args.steps + 8, ignore_eos=True)
    llm.generate(prompts, warm)  # graphs captured, kernels compiled
    engine = llm.engine
    for i, p in enumerate(prompts):
        kw = {"prompt_token_ids": p["prompt_token_ids"]} if isinstance(p, dict) else {"prompt": p}
        engine.add_request(f"p{i}", params=warm, **kw)
    target = engine.counters["generation_tokens_total"] + 2 * args.batch
    while engine.counters["generation_tokens_total"] < target:  # prefill and two decode steps
        engine.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    if args.host:  # where the host's time goes while it keeps the GPU fed
        before, t0 = engine.metrics(), time.perf_counter()
        walls = []
        for _ in range(args.steps):
            engine.step()
            walls.append(time.perf_counter())
        wall = (time.perf_counter() - t0) / args.steps * 1000
        gaps = [round((b - a) * 1000, 2) for a, b in zip([t0, *walls], walls, strict=False)]
        print("step walls ms:", gaps)
        idle = gpu_idle_frac(before, engine.metrics()) if "decode_gpu_idle_seconds_total" in before else None
        print(f"unprofiled: {wall:.3f} ms a step (wall); GPU idle between steps: {idle}")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.steps):
            engine.step()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(args.top)
        for name in args.callees:
            pstats.Stats(prof).print_callees(name)
        return
    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            engine.step()
        if cuda:
            torch.cuda.synchronize()
    while engine.has_unfinished():
        engine.step()
    per_kernel: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    spans = []  # (start, end) us of every GPU activity
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0:
            per_kernel[ev.name][0] += ev.device_time_total
            per_kernel[ev.name][1] += 1
            spans.append((ev.time_range.start, ev.time_range.end))
    total = max(1e-9, sum(v[0] for v in per_kernel.values()))  # 0 on a CPU dry run
    groups: dict[str, float] = collections.defaultdict(float)
    for name, (us, _) in per_kernel.items():
        groups[group_of(name)] += us
    print(f"workload {args.workload} batch {args.batch} steps {args.steps}")
    print(f"GPU time per step: {total / args.steps / 1000:.3f} ms; shared work lists {dict(TMA_STEPS)}")
    busy, idle = busy_and_idle(spans)
    print(f"GPU timeline per step: busy {busy / args.steps / 1000:.3f} ms, idle between kernels "
          f"{idle / args.steps / 1000:.3f} ms (first kernel to last)")
    print("| group | ms a step | share |")
    for g, us in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"| {g} | {us / args.steps / 1000:.3f} | {us / total:.1%} |")
    print("| kernel | ms a step | calls a step |")
    rows = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])
    for name, (us, n) in rows[: args.top]:
        print(f"| {name[:90]} | {us / args.steps / 1000:.4f} | {n / args.steps:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "per_step_ms": total / args.steps / 1000,
                       "groups": groups, "kernels": {k: v for k, v in rows}}, f, indent=1)


if __name__ == "__main__":
    main()
