"""Where rank 0's host time goes in a decode step, and whether the GPU waits for it.

With launch-ahead the host has one GPU step to complete the step before, schedule, assemble and
launch the next; when it needs longer, the GPU waits at the step boundary (gaps before the first
kernel of a step, which the engine's between-steps idle timer does not count). At two ranks a
decode step's kernels take about 60% of one rank's, so a host that kept up at TP=1 may not.

This wraps the engine's per-step calls (scheduler, batch assembly and attention planning, the
launch, the sampling's issue, the completion) with wall-clock timers, runs B requests sharing a
P-token prefix on the 8B-shaped dummy model as ``tp_step_profile.py`` does, and reports each
call's host milliseconds per decode step (the long run less a short one, so prefill drops out),
beside the decode step's time. Nested calls are timed on their own too, so rows overlap. On the
GPU side, CUDA events recorded as rank 0 enters and leaves the forward, the graph replay and the
sampling give the device's milliseconds between them over the long run's last decode steps: the
replay, the sampling, and the gaps between (where the GPU waits for the host).

PYTHONPATH=. python -m benchmarks.probes.host_phases --tp 2 --json out/host_tp2.json
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import gc
import importlib
import itertools
import json
import pstats
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from benchmarks.decode_run import GCPauses, add_shared_run_args, decode_ms_per_step, shared_prompts
from benchmarks.harness.info import git_commit
from prefixserve import LLM, SamplingParams

PHASES = (  # module, class (or "" for a function), attribute
    ("prefixserve.engine.llm_engine", "Engine", "step"),
    ("prefixserve.scheduler.scheduler", "Scheduler", "schedule"),
    ("prefixserve.scheduler.scheduler", "Scheduler", "update_from_output"),
    ("prefixserve.engine.llm_engine", "Engine", "_assemble_batch"),
    ("prefixserve.worker.model_runner", "ModelRunner", "prepare_batch"),
    ("prefixserve.engine.llm_engine", "Engine", "_launch"),
    ("prefixserve.worker.model_runner", "ModelRunner", "forward"),
    ("prefixserve.engine.in_flight", "InFlightTokens", "mark_launched"),
    ("prefixserve.engine.llm_engine", "Engine", "_sample"),
    ("prefixserve.engine.llm_engine", "Engine", "_complete"),
    ("prefixserve.worker.model_runner", "ModelRunner", "wait"),
    ("prefixserve.worker.tp_runner", "TensorParallelRunner", "wait"),
    ("prefixserve.worker.tp_runner", "TensorParallelRunner", "call"),
    ("prefixserve.engine.llm_engine", "Engine", "_place_and_report"),
)


MARKS = (  # where CUDA events go on rank 0's stream: module, class, method
    ("prefixserve.worker.model_runner", "ModelRunner", "forward"),
    ("prefixserve.worker.cuda_graph", "DecodeGraphs", "run"),
    ("prefixserve.worker.model_runner", "ModelRunner", "sample"),
)


class Timers:
    """Seconds and calls per wrapped name; CUDA events at the marked calls' entries and exits."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.events: list[tuple[str, torch.cuda.Event]] | None = None  # recording when a list

    def mark(self, label: str) -> None:
        if self.events is not None:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append((label, event))

    def mark_calls(self, module: str, owner: str, name: str) -> None:
        target = getattr(importlib.import_module(module), owner)
        fn = getattr(target, name)

        @functools.wraps(fn)
        def marked(*args: Any, **kwargs: Any) -> Any:
            self.mark(f"{owner}.{name}")
            try:
                return fn(*args, **kwargs)
            finally:
                self.mark(f"{owner}.{name} end")

        setattr(target, name, marked)

    def gpu_ms(self, steps: int) -> dict[str, float]:
        """Device ms per step between consecutive marks, over the last ``steps`` graph replays."""
        assert self.events is not None
        torch.cuda.synchronize()
        starts = [i for i, (label, _) in enumerate(self.events) if label == "DecodeGraphs.run"]
        if len(starts) <= steps:  # no decode graphs (a sliding-window model): step at the forwards
            starts = [i for i, (label, _) in enumerate(self.events) if label == "ModelRunner.forward"]
        first, last = starts[-steps - 1], starts[-1]
        out: dict[str, float] = defaultdict(float)
        window = self.events[first : last + 1]
        for (a, start), (b, end) in itertools.pairwise(window):
            out[f"{a} -> {b}"] += start.elapsed_time(end) / steps
        return dict(out)

    def wrap(self, module: str, owner: str, name: str) -> None:
        target = importlib.import_module(module)
        if owner:
            target = getattr(target, owner)
        if name not in vars(target):  # inherited: time it where it is defined
            return
        fn = getattr(target, name)
        key = f"{owner}.{name}" if owner else name

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[key] += time.perf_counter() - start
                self.calls[key] += 1

        setattr(target, name, timed)

    def snapshot(self) -> tuple[dict[str, float], dict[str, int]]:
        return dict(self.seconds), dict(self.calls)


def run(
    llm: LLM, timers: Timers, args: argparse.Namespace, gen: int, seed: int, profile: bool = False
) -> tuple[dict, float, dict]:
    """Timer deltas over one generate call, its decode ms per step, and (``profile``) its cProfile
    stats and the cyclic GC passes it met."""
    params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    prompts = shared_prompts(args.batch, args.prefix, args.own, seed=seed)
    before, _ = timers.snapshot()
    pauses = GCPauses()
    profiler = cProfile.Profile() if profile else None
    gc.callbacks.append(pauses)
    if profiler is not None:
        profiler.enable()
    try:
        outs = llm.generate(prompts, params)
    finally:
        if profiler is not None:
            profiler.disable()
        gc.callbacks.remove(pauses)
    after, _ = timers.snapshot()
    extra = {"gc_pause_s": pauses.total, "gc_full_passes": pauses.full}
    if profiler is not None:
        extra["stats"] = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    return {k: after[k] - before.get(k, 0.0) for k in after}, decode_ms_per_step(outs, gen), extra


def profile_diff(long: dict, short: dict, steps: int, top: int) -> list[tuple[float, float, int, str]]:
    """Functions by cumulative host ms a decode step: the long run's cProfile less the short one's
    (prefill and admission cancel out); (cumulative, own, calls a step, name)."""
    rows = []
    for key, (_, calls, own, cum, _callers) in long.items():
        s_calls, s_own, s_cum = short.get(key, (0, 0, 0.0, 0.0, None))[1:4]
        name = f"{Path(key[0]).name}:{key[1]}({key[2]})"
        rows.append(
            (1e3 * (cum - s_cum) / steps, 1e3 * (own - s_own) / steps, (calls - s_calls) // steps, name)
        )
    return sorted(rows, reverse=True)[:top]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shared_run_args(ap, gen=96, short_gen=16)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", default=None)
    ap.add_argument("--keep-sliding-kv", action="store_true", help="every layer's KV kept (kv/layout.py)")
    ap.add_argument("--cprofile", type=int, default=0, help="list the long run's N costliest functions")
    args = ap.parse_args()
    timers = Timers()
    for module, owner, name in PHASES:
        timers.wrap(module, owner, name)
    if args.device.startswith("cuda"):
        for module, owner, name in MARKS:
            timers.mark_calls(module, owner, name)
    llm = LLM(
        model=args.model,
        tensor_parallel_size=args.tp,
        dtype="bfloat16",
        device=args.device,
        max_num_seqs=args.batch,
        max_num_batched_tokens=16384,
        progress=False,
        keep_sliding_kv=args.keep_sliding_kv,
    )
    run(llm, timers, args, args.gen, seed=1)  # warm: graphs, compiles
    short, _, short_extra = run(llm, timers, args, args.short_gen, seed=2, profile=args.cprofile > 0)
    timers.events = [] if args.device.startswith("cuda") else None
    long, decode_ms, long_extra = run(llm, timers, args, args.gen, seed=3, profile=args.cprofile > 0)
    steps = args.gen - args.short_gen
    per_step = {k: 1e3 * (long[k] - short.get(k, 0.0)) / steps for k in long}
    gpu = timers.gpu_ms(min(steps, args.gen // 2)) if timers.events is not None else {}
    llm.shutdown()
    result = {
        "tp": args.tp,
        "batch": args.batch,
        "prefix": args.prefix,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
        "torch": torch.__version__,
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "decode_ms_per_step": decode_ms,
        "host_ms_per_step": per_step,
        "gpu_ms_per_step_between_marks": gpu,
        "keep_sliding_kv": args.keep_sliding_kv,
        "gc_pause_s": {"short": short_extra["gc_pause_s"], "long": long_extra["gc_pause_s"]},
        "gc_full_passes": {"short": short_extra["gc_full_passes"], "long": long_extra["gc_full_passes"]},
    }
    print(
        f"TP={args.tp} B={args.batch} P={args.prefix}: decode {decode_ms:.2f} ms/step; host ms a decode step:"
    )
    for k, ms in sorted(per_step.items(), key=lambda kv: -kv[1]):
        print(f"  {ms:7.3f}  {k}")
    if gpu:
        print(f"rank 0's GPU, ms a decode step between marks ({sum(gpu.values()):.3f} in all):")
        for k, ms in sorted(gpu.items(), key=lambda kv: -kv[1]):
            print(f"  {ms:7.3f}  {k}")
    print(f"GC pauses: {result['gc_pause_s']} s, full passes {result['gc_full_passes']}")
    if args.cprofile:
        rows = profile_diff(long_extra["stats"], short_extra["stats"], steps, args.cprofile)
        result["cprofile_ms_per_step"] = [
            {"cumulative": c, "own": o, "calls": n, "function": f} for c, o, n, f in rows
        ]
        print("cProfile, the long run less the short, ms a decode step (cumulative, own, calls):")
        for c, o, n, f in rows:
            print(f"  {c:8.3f} {o:8.3f} {n:6d}  {f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
