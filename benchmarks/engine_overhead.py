"""Where an eager decode step's time goes, per attention backend (host parts timed with perf_counter).

The engine's own timers only split a step into "host" (outside forward + sampling) and the rest; in
eager mode the forward's kernel launches are host work too. This script wraps the engine's parts
(schedule, build_metadata, backend.prepare, model forward, backend.forward per layer, sample) from
the outside, without touching the engine, and adds the GPU time of the attention calls (CUDA events,
read after each step's sampling has synced). Only decode-only steps are counted.

    PYTHONPATH=. python -m benchmarks.engine_overhead --batches 64 256 --prefix 4096
    git show HEAD:prefixserve/attention/kernels/triton_backend.py > /tmp/old.py
    PYTHONPATH=. python -m benchmarks.engine_overhead --old /tmp/old.py --backends triton_old auto

``--old FILE`` loads an earlier triton_backend.py as "triton_old" / "triton_paged_old" (before/after).
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

import prefixserve.engine as engine_mod
from benchmarks.throughput import _prompts
from prefixserve import LLM, SamplingParams
from prefixserve.attention.backend import make_backend


def _timed(timers: Counter[str], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            timers[name] += time.perf_counter() - t0

    return wrapper


def profile(llm: LLM, attention: str, prompts: list[dict], gen: int) -> dict[str, float]:
    """Decode ``prompts`` with ``attention`` swapped into the engine; per-step means in ms."""
    eng = llm.engine
    eng.backend = make_backend(attention)
    llm.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True))  # compile this batch's kernels
    step_t: Counter[str] = Counter()
    total: Counter[str] = Counter()
    events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    decode = {"on": False}
    backend = eng.backend
    prepare, forward = backend.prepare, backend.forward

    def prep(meta: Any) -> None:
        decode["on"] = meta.is_decode_only
        prepare(meta)

    def fwd(*args: Any, **kwargs: Any) -> torch.Tensor:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = forward(*args, **kwargs)
        end.record()
        events.append((start, end))
        return out

    backend.prepare = _timed(step_t, "prepare", prep)  # type: ignore[method-assign]
    backend.forward = _timed(step_t, "attn_host", fwd)  # type: ignore[method-assign]
    saved = (eng.scheduler.schedule, engine_mod.build_metadata, eng.model.forward, engine_mod.sample)
    eng.scheduler.schedule = _timed(step_t, "schedule", saved[0])  # type: ignore[method-assign]
    engine_mod.build_metadata = _timed(step_t, "build_metadata", saved[1])
    eng.model.forward = _timed(step_t, "model_fwd_host", saved[2])  # type: ignore[method-assign]
    engine_mod.sample = _timed(step_t, "sample_sync", saved[3])
    step = eng.step
    params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", params=params, prompt_token_ids=p["prompt_token_ids"])
    try:
        while eng.has_unfinished():
            step_t.clear()
            events.clear()
            decode["on"] = False
            t0 = time.perf_counter()
            step()
            wall = time.perf_counter() - t0
            if decode["on"]:
                total["steps"] += 1
                total["step"] += wall
                total["attn_gpu"] += sum(s.elapsed_time(e) for s, e in events) / 1e3
                total["layers"] += len(events)
                for k, v in step_t.items():
                    total[k] += v
    finally:
        eng.scheduler.schedule = saved[0]  # type: ignore[method-assign]
        engine_mod.build_metadata = saved[1]
        eng.model.forward = saved[2]  # type: ignore[method-assign]
        engine_mod.sample = saved[3]
        del backend.prepare, backend.forward
    n = max(total["steps"], 1)
    out = {k: 1e3 * total[k] / n for k in ("step", "schedule", "build_metadata", "prepare", "model_fwd_host")}
    out.update(
        sample_sync=1e3 * total["sample_sync"] / n,
        attn_host_per_layer_us=1e6 * total["attn_host"] / max(total["layers"], 1),
        attn_gpu_per_layer_us=1e6 * total["attn_gpu"] / max(total["layers"], 1),
        tok_s=len(prompts) * n / max(total["step"], 1e-9),
        steps=total["steps"],
    )
    return out


def load_old(path: str) -> None:
    """Register an earlier triton_backend.py's classes as "triton_old" and "triton_paged_old"."""
    import importlib.util

    from prefixserve.attention import backend as registry
    from prefixserve.attention.kernels import triton_backend as new

    spec = importlib.util.spec_from_file_location("_old_triton_backend", path)
    assert spec is not None and spec.loader is not None
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)  # registers its classes under the current names: put ours back
    registry.register_backend(new.TritonPagedBackend)
    registry.register_backend(new.TritonBackend)
    registry.register_backend(type("OldTriton", (old.TritonBackend,), {"name": "triton_old"}))
    registry.register_backend(type("OldPaged", (old.TritonPagedBackend,), {"name": "triton_paged_old"}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--prefix", type=int, default=4096)
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--backends", nargs="+", default=["triton_paged", "triton", "auto"])
    ap.add_argument("--old", help="an earlier triton_backend.py, registered as triton_old / triton_paged_old")
    args = ap.parse_args()
    if args.old:
        load_old(args.old)
    rows = []
    for b in args.batches:
        llm = LLM(
            model=args.model,
            dtype="bfloat16",
            device="cuda",
            attention="triton_paged",
            max_num_seqs=b,
            max_num_batched_tokens=16384,
            progress=False,
        )
        prompts = _prompts(b, args.prefix, 64)
        for name in args.backends:
            r = profile(llm, name, prompts, args.gen)
            rows.append({"B": b, "attention": name, **r})
            print(rows[-1], flush=True)
        del llm
        torch.cuda.empty_cache()
    cols = ["step", "schedule", "build_metadata", "prepare", "model_fwd_host", "sample_sync"]
    print("\nper decode step, ms (host parts; model_fwd_host = launching the 32 layers)")
    print(f"| B | attention | tok/s | {' | '.join(cols)} | attn host us/layer | attn GPU us/layer |")
    print("|" + " ---: |" * (len(cols) + 5))
    for r in rows:
        vals = " | ".join(f"{r[c]:.2f}" for c in cols)
        print(
            f"| {r['B']} | {r['attention']} | {r['tok_s']:.0f} | {vals} | "
            f"{r['attn_host_per_layer_us']:.0f} | {r['attn_gpu_per_layer_us']:.0f} |"
        )


if __name__ == "__main__":
    main()
