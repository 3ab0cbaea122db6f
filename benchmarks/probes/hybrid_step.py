"""Where a linear-attention hybrid's decode step spends the GPU's time: ``--samples`` samples of one
``--prefix``-token prompt (dummy weights), a few decode steps timed (wall), then under
``torch.profiler``, with the shared path (``auto``) and without (``triton_paged``), the kernels that
took the most CUDA time.

    PYTHONPATH=. python -m benchmarks.probes.hybrid_step [--model dummy:qwen3.5-27b] [--json F]
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from pathlib import Path

import torch


def profile(
    model: str, attention: str, samples: int, prefix: int, steps: int, top: int, quantization: str | None
) -> dict:
    from prefixserve import LLM, SamplingParams

    gc.collect()
    torch.cuda.empty_cache()
    rng = random.Random(0)
    prompt = {"prompt_token_ids": [rng.randrange(1000, 30000) for _ in range(prefix)]}
    chunk = 8192
    llm = LLM(model=model, device="cuda", dtype="bfloat16", attention=attention, max_num_seqs=samples,
              max_num_batched_tokens=chunk, quantization=quantization, progress=False)  # fmt: skip
    engine = llm.engine
    params = SamplingParams(n=samples, temperature=1.0, max_tokens=2 * steps + 8, ignore_eos=True)
    engine.add_request("r", None, params, prompt_token_ids=prompt["prompt_token_ids"])
    for _ in range(-(-prefix // chunk) + 4):  # the prefill's chunks, the forks, decode steps: warm
        engine.step()
    decoding = [s for s in engine.scheduler.running if s.num_tokens > s.num_prompt_tokens + 1]
    assert len(decoding) == samples, f"{len(decoding)} of {samples} samples decoding"
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):  # wall time a step, the profiler off: host-bound where above the GPU's
        engine.step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - started) * 1e3 / steps
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    while engine.has_unfinished():
        engine.step()
    llm.shutdown()
    rows = []
    for e in prof.key_averages():
        cuda_us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if cuda_us > 0:
            rows.append(
                {"kernel": e.key[:90], "ms_a_step": cuda_us / 1e3 / steps, "calls_a_step": e.count / steps}
            )
    rows.sort(key=lambda r: -r["ms_a_step"])
    gpu_ms = sum(r["ms_a_step"] for r in rows)
    return {"attention": attention, "wall_ms_a_step": wall_ms, "gpu_ms_a_step": gpu_ms, "top": rows[:top]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dummy:qwen3.5-27b")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--prefix", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--quantization", choices=["fp8"], default=None, help="FP8 weights")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    from benchmarks.harness import run_info
    from benchmarks.harness.output import write_or_print

    result = {**run_info(("fla-core",)), "settings": {k: str(v) for k, v in vars(args).items()}, "runs": []}
    weights = "FP8 weights" if args.quantization else "bf16"
    shape = f"{args.model}, {weights}, {args.samples} samples of {args.prefix} tokens"
    lines = [f"# Hybrid decode step by kernel ({shape})"]
    for attention in ("auto", "triton_paged"):
        run = profile(
            args.model, attention, args.samples, args.prefix, args.steps, args.top, args.quantization
        )
        result["runs"].append(run)
        took = f"{run['gpu_ms_a_step']:.1f} GPU ms, {run['wall_ms_a_step']:.1f} wall ms a step"
        lines += ["", f"## {attention}: {took}", "",
                  "| kernel | ms a step | calls a step |", "| --- | ---: | ---: |"]  # fmt: skip
        lines += [f"| `{r['kernel']}` | {r['ms_a_step']:.2f} | {r['calls_a_step']:.0f} |" for r in run["top"]]
    write_or_print(args.json, result, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
