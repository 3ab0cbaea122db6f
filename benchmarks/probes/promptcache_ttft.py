"""Probe: where a Prompt Cache request's first token goes (issue 103's host-tier target, 14x full prefill).

The workload of ``benchmarks/promptcache.py``'s TTFT section at one length: a PML prompt importing
``--length`` / ``--module-tokens`` modules of the schema plus the 168-token question, one token
generated (``--context-segments off``: the question's attention over its modules on the paged kernel,
not as a one-holder segment). For the GPU tier and the host tier (modules moved out first),
``--trials`` requests after an untimed one: the wall time, the GPU's busy time (the engine's
``gpu_busy_seconds_total``), and for one more request of each tier the host's profile (cProfile,
top functions by own time and by cumulative time) and the device's (torch.profiler: kernel time
by name, the sum of kernel time and the launches). So the first token's wall splits into the
device's work and what the host adds.

    PYTHONPATH=. python -m benchmarks.probes.promptcache_ttft [--kv-cache-dtype fp8] [--out DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import run_info
from benchmarks.promptcache import make_llm
from benchmarks.promptcache_workload import bench_schema, prompts_for, ttft

QUESTION = " " + " ".join(["Which", "word", "came", "first", "in", "the", "notes", "above?"] * 4)


def host_profile(llm: Any, prompt: str, top: int) -> dict[str, Any]:
    """One request under cProfile: the top functions by own and cumulative time (ms)."""
    prof = cProfile.Profile()
    _sync()
    prof.enable()
    wall = ttft(llm, prompt)
    prof.disable()
    stats = pstats.Stats(prof)
    rows = []
    for (path, line, name), (_cc, calls, own, cum, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append(
            {
                "fn": f"{Path(path).name}:{line}:{name}",
                "calls": calls,
                "own_ms": own * 1e3,
                "cum_ms": cum * 1e3,
            }
        )
    by_own = sorted(rows, key=lambda r: -r["own_ms"])[:top]
    by_cum = sorted(rows, key=lambda r: -r["cum_ms"])[:top]
    return {"wall_ms": wall * 1e3, "by_own": by_own, "by_cum": by_cum}


def device_profile(llm: Any, prompt: str, top: int) -> dict[str, Any]:
    """One request under torch.profiler: kernel time by name, their sum, the launches, the wall."""
    from torch.profiler import ProfilerActivity, profile

    _sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = ttft(llm, prompt)
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(event.name, []).append(event.device_time / 1e3)
    total = sum(sum(v) for v in kernels.values())
    named = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {
        "wall_ms": wall * 1e3,
        "kernel_ms": total,
        "launches": sum(len(v) for v in kernels.values()),
        "top": [{"name": n[:120], "count": len(v), "ms": sum(v)} for n, v in named],
    }


def timed(llm: Any, prompt: str) -> tuple[float, float]:
    """(wall ms, GPU busy ms) of one request."""
    before = llm.metrics()["gpu_busy_seconds_total"]
    wall = ttft(llm, prompt)
    return wall * 1e3, (llm.metrics()["gpu_busy_seconds_total"] - before) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--device", default="cuda", help="cpu: the code paths only (a smoke run)")
    ap.add_argument("--kv-cache-dtype", default="fp8")
    ap.add_argument("--module-tokens", type=int, default=512)
    ap.add_argument("--length", type=int, default=5120)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default="/tmp/promptcache_ttft")
    ap.add_argument(
        "--context-segments", choices=("on", "off", "every"), default="on",
        help="on: the shipped ContextRule; off: the question's attention over its modules on the "
        "paged kernel (TritonBackend.context_rule = None); every: each module run a one-holder "
        "segment whatever its size, for an A/B against the shipped rule",
    )  # fmt: skip
    args = ap.parse_args()
    if args.trials < 1:
        ap.error("--trials must be at least 1")
    if args.context_segments != "on":
        from benchmarks.probes.context_segments import every_rule
        from prefixserve.attention.triton_backend import TritonBackend

        TritonBackend.context_rule = None if args.context_segments == "off" else every_rule()
    settings = argparse.Namespace(
        model=args.model, device=args.device, kv_cache_dtype=args.kv_cache_dtype, num_kv_blocks=None,
        max_num_batched_tokens=8192,
    )  # fmt: skip
    llm = make_llm(settings)
    tok = llm.get_tokenizer()
    count = args.length // args.module_tokens
    schema, texts = bench_schema(tok, 2 * count, args.module_tokens, 0)
    llm.register_schema(schema)
    rng = random.Random(1)
    walls: dict[str, list[float]] = {"full": [], "gpu": [], "host": []}
    busy: dict[str, list[float]] = {"full": [], "gpu": [], "host": []}
    profiles: dict[str, Any] = {}
    for trial in range(args.trials + 2):
        pml, plain, _ = prompts_for(rng, texts, count, QUESTION)
        llm.generate(pml.replace(QUESTION, " Warm" + QUESTION), _one_token())
        last = trial == args.trials + 1
        if last:
            profiles["gpu_host"] = host_profile(llm, pml.replace(QUESTION, " A" + QUESTION), args.top)
            profiles["gpu_device"] = device_profile(llm, pml.replace(QUESTION, " B" + QUESTION), args.top)
            llm.engine.modules.move_out()
            profiles["host_host"] = host_profile(llm, pml.replace(QUESTION, " C" + QUESTION), args.top)
            llm.engine.modules.move_out()
            profiles["host_device"] = device_profile(llm, pml.replace(QUESTION, " D" + QUESTION), args.top)
            break
        got = {
            "full": timed(llm, {"prompt": plain, "cache_salt": f"fresh-{trial}"}),
            "gpu": timed(llm, pml),
        }
        llm.engine.modules.move_out()
        got["host"] = timed(llm, pml.replace(QUESTION, " Host" + QUESTION))
        if trial:
            for mode, (w, b) in got.items():
                walls[mode].append(w)
                busy[mode].append(b)
    summary = {
        mode: {"wall_ms": statistics.median(walls[mode]), "gpu_busy_ms": statistics.median(busy[mode])}
        for mode in walls
    }
    for mode, s in summary.items():
        print(f"{mode:5s} wall {s['wall_ms']:7.2f} ms  GPU busy {s['gpu_busy_ms']:7.2f} ms")
    for name, p in profiles.items():
        print(f"\n{name}: wall {p['wall_ms']:.2f} ms", end="")
        if "kernel_ms" in p:
            print(f", kernels {p['kernel_ms']:.2f} ms in {p['launches']} launches")
            for r in p["top"][:12]:
                print(f"  {r['ms']:7.3f} ms {r['count']:5d}  {r['name'][:90]}")
        else:
            print()
            for r in p["by_cum"][:20]:
                print(f"  cum {r['cum_ms']:7.2f} own {r['own_ms']:6.2f} {r['calls']:6d}  {r['fn'][:90]}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"info": run_info(), "settings": vars(args), "summary": summary, "profiles": profiles}
    (out / "promptcache_ttft.json").write_text(json.dumps(result, indent=1))
    print(f"\nwritten {out / 'promptcache_ttft.json'} at {time.strftime('%H:%M:%S')}")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _one_token() -> Any:  # a request's first token only
    from prefixserve import SamplingParams

    return SamplingParams(max_tokens=1)


if __name__ == "__main__":
    main()
