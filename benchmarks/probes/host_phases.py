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
import functools
import importlib
import itertools
import json
import time
from collections import defaultdict
from typing import Any

import torch

from benchmarks.decode_run import add_shared_run_args, decode_ms_per_step, shared_prompts
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


def run(llm: LLM, timers: Timers, args: argparse.Namespace, gen: int, seed: int) -> tuple[dict, float]:
    """Timer deltas over one generate call, and its decode ms per step."""
    params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    before, _ = timers.snapshot()
    outs = llm.generate(shared_prompts(args.batch, args.prefix, args.own, seed=seed), params)
    after, _ = timers.snapshot()
    return {k: after[k] - before.get(k, 0.0) for k in after}, decode_ms_per_step(outs, gen)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shared_run_args(ap, gen=96, short_gen=16)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", default=None)
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
    )
    run(llm, timers, args, args.gen, seed=1)  # warm: graphs, compiles
    short, _ = run(llm, timers, args, args.short_gen, seed=2)
    timers.events = [] if args.device.startswith("cuda") else None
    long, decode_ms = run(llm, timers, args, args.gen, seed=3)
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
