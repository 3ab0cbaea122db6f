"""Where a graphed decode step's time goes: replay (CUDA events), host planning, logits + sampling.

For each attention mode, decode a batch that shares one prefix and time, per decode step, the graph
replay on the GPU (events around ``replay``), the host work before it (planning, buffer loads) and the
rest of the step; then profile one replay with torch.profiler and list its costliest kernels.

    PYTHONPATH=. python -m benchmarks.probes.graph_step_probe --batch 64 --prefix 4096
"""

from __future__ import annotations

import argparse
import gc
import time
from collections import Counter
from typing import Any

import torch

from benchmarks.throughput import MODES, _prompts
from prefixserve import LLM, SamplingParams
from prefixserve.engine import cuda_graph


def probe(mode: str, attention: str, prompts: list[dict], gen: int, top: int) -> dict[str, Any]:
    llm = LLM(
        model="dummy:llama-3.1-8b",
        dtype="bfloat16",
        device="cuda",
        attention=attention,
        max_num_seqs=len(prompts),
        max_num_batched_tokens=16384,
        progress=False,
    )
    warm = _prompts(len(prompts), len(prompts[0]["prompt_token_ids"]) - 64, 64, seed=1)
    t0 = time.perf_counter()
    llm.generate(warm, SamplingParams(max_tokens=3, ignore_eos=True))  # compile, capture this shape's graph
    warm_s = time.perf_counter() - t0
    graphs = llm.engine.graphs
    engine = llm.engine
    events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    marks: dict[str, float] = {}
    split: list[tuple[float, float, float]] = []  # decode steps: (before run, run, after run) seconds
    original_run, original_step = cuda_graph.DecodeGraphs.run, engine.step

    def run(self: Any, *args: Any) -> torch.Tensor:
        marks["run0"] = time.perf_counter()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = original_run(self, *args)
        end.record()
        events.append((start, end))
        marks["run1"] = time.perf_counter()
        return out

    def step() -> Any:
        marks.clear()
        t0 = time.perf_counter()
        out = original_step()
        t1 = time.perf_counter()
        if "run0" in marks:
            split.append((marks["run0"] - t0, marks["run1"] - marks["run0"], t1 - marks["run1"]))
        return out

    cuda_graph.DecodeGraphs.run = run
    engine.step = step
    try:
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=gen, ignore_eos=True))
        wall = time.perf_counter() - t0
    finally:
        cuda_graph.DecodeGraphs.run = original_run
        del engine.step
    torch.cuda.synchronize()
    replay_ms = sorted(s.elapsed_time(e) for s, e in events)

    def median_ms(i: int) -> float:
        xs = sorted(x[i] for x in split)
        return 1e3 * xs[len(xs) // 2] if xs else float("nan")

    before, during, after = median_ms(0), median_ms(1), median_ms(2)
    result = {
        "mode": mode,
        "decode_steps": len(split),
        "wall_s": round(wall, 3),
        "warmup_s": round(warm_s, 3),
        "replay_gpu_ms": round(replay_ms[len(replay_ms) // 2], 3) if replay_ms else None,
        "step_ms": round(before + during + after, 3),
        "host_before_ms": round(before, 3),  # schedule, metadata, attention planning
        "run_ms": round(during, 3),  # input + plan copies, replay launch
        "after_ms": round(after, 3),  # logits, sampling (waits for the replay), bookkeeping
        "graphs": graphs.captures if graphs else 0,
        "keys": [str(k[:4]) for k in (graphs.graphs if graphs else {})],
    }
    if graphs and graphs.graphs:
        entry = next(reversed(graphs.graphs.values()))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            entry.graph.replay()
            torch.cuda.synchronize()
        kernels: Counter[str] = Counter()
        counts: Counter[str] = Counter()
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                name = ev.name[:60]
                kernels[name] += ev.device_time_total
                counts[name] += 1
        result["top_kernels_us"] = [(n, round(t, 1), counts[n]) for n, t in kernels.most_common(top)]
        result["kernel_total_us"] = round(sum(kernels.values()), 1)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prefix", type=int, default=4096)
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--modes", nargs="+", default=list(MODES))
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    prompts = _prompts(args.batch, args.prefix, 64)
    for mode in args.modes:
        r = probe(mode, MODES[mode], prompts, args.gen, args.top)
        kernels = r.pop("top_kernels_us", [])
        print(r, flush=True)
        for name, us, n in kernels:
            print(f"    {us:10.1f} us  x{n:<5d} {name}")


if __name__ == "__main__":
    main()
