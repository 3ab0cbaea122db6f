"""Many tenants on one engine (issue 106): salt scope, and fair shares, with Poisson arrivals.

Parts (``--parts``), each a fresh engine per mode, driven in-process (requests added at their arrival
times, one engine step after another; TTFT from each request's arrival to its first token):
  salts  ``--tenants`` tenants, each one request: one public ``--system``-token system prompt and a
         ``--private``-token part of its own, every request salted with its tenant; the salt's scope
         ``prompt`` (vLLM's: the whole prompt salted) against ``after-system`` (the system prompt
         shared): prompt tokens computed, against 1.1 x (system + tenants x private), and TTFT
  fair   one tenant at ``--heavy-x`` times the rate of ``--light`` others: TTFT p99 of the light
         tenants under ``fcfs`` and ``fair``, against the light tenants alone at their own rate

    python -m benchmarks.tenants run --model dummy:llama-3.1-8b --device cuda [--out docs/benchmarks]
    python -m benchmarks.tenants run --smoke   # the tiny model on the CPU, into /tmp/tenants
    python -m benchmarks.tenants report --json docs/benchmarks/tenants.json
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import RESULTS, TINY, dummy_model, pct, pyplot, run_info
from benchmarks.harness.output import run_or_report, write_results

NAME = "tenants"


def _engine(args: argparse.Namespace, policy: str = "fcfs") -> Any:
    from prefixserve.config import EngineConfig
    from prefixserve.engine import Engine

    config = EngineConfig(
        model=args.model, device=args.device, scheduling_policy=policy, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_batched_tokens,
        **({"num_kv_blocks": args.num_kv_blocks} if args.num_kv_blocks else {}),
    )  # fmt: skip
    return Engine(config, progress=False)


def _run_engine(args: argparse.Namespace, policy: str, arrivals: list, gen: int) -> dict[str, Any]:
    """One fresh engine drives ``arrivals``; it is shut down and its KV pool and graphs freed before the
    next engine sizes its own."""
    import gc

    import torch

    engine = _engine(args, policy)
    try:
        return _drive(engine, arrivals, gen)
    finally:
        engine.shutdown()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            print(f"after the engine: {torch.cuda.memory_allocated() / 1e9:.2f} GB allocated", flush=True)


def _drive(engine: Any, arrivals: list[tuple[float, dict[str, Any]]], gen: int) -> dict[str, Any]:
    """Add each request at its arrival (seconds from the start) and step until all are done; each
    request's TTFT (arrival to first token) and the prompt tokens the engine computed."""
    from prefixserve import SamplingParams

    params = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
    before = engine.counters["prompt_tokens_computed_total"]
    pending = sorted(arrivals, key=lambda a: a[0])
    due: dict[str, float] = {}
    ttft: dict[str, float] = {}
    start, i = time.perf_counter(), 0
    while i < len(pending) or engine.has_unfinished():
        now = time.perf_counter() - start
        while i < len(pending) and pending[i][0] <= now:
            at, req = pending[i]
            rid = req["request_id"]
            due[rid] = at
            engine.add_request(
                rid, None, params, stream=True, **{k: v for k, v in req.items() if k != "request_id"}
            )
            i += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[i][0] - now))
            continue
        for out in engine.step():
            if out.request_id not in ttft and out.outputs and out.outputs[0].token_ids:
                ttft[out.request_id] = time.perf_counter() - start - due[out.request_id]
    return {
        "ttft": ttft,
        "wall_s": time.perf_counter() - start,
        "prompt_tokens_computed": engine.counters["prompt_tokens_computed_total"] - before,
    }


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 30000) for _ in range(n)]


def salts_part(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(0)
    system = _tokens(rng, args.system)
    privates = [_tokens(rng, args.private) for _ in range(args.tenants)]
    times, t = [], 0.0
    for _ in range(args.tenants):
        t += rng.expovariate(args.rate)
        times.append(t)
    out: dict[str, Any] = {"bound_tokens": 1.1 * (args.system + args.tenants * args.private)}
    for scope in ("prompt", "after-system"):
        public = args.system if scope == "after-system" else 0
        arrivals = [
            (at, {"request_id": f"t{k}", "prompt_token_ids": [*system, *own], "cache_salt": f"tenant-{k}",
                  "public_tokens": public, "tenant": f"tenant-{k}"})
            for k, (at, own) in enumerate(zip(times, privates, strict=True))
        ]  # fmt: skip
        got = _run_engine(args, "fcfs", arrivals, args.gen)
        ttfts = list(got["ttft"].values())
        out[scope] = {
            "prompt_tokens_computed": got["prompt_tokens_computed"],
            "ttft_p50_s": pct(ttfts, 0.5),
            "ttft_p99_s": pct(ttfts, 0.99),
            "wall_s": got["wall_s"],
        }
        print(scope, out[scope], flush=True)
    out["computed_over_bound"] = out["after-system"]["prompt_tokens_computed"] / out["bound_tokens"]
    out["ttft_p50_x"] = out["prompt"]["ttft_p50_s"] / out["after-system"]["ttft_p50_s"]
    return out


def fair_part(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(1)
    light = [f"light-{k}" for k in range(args.light)]

    def arrivals(with_heavy: bool) -> list[tuple[float, dict[str, Any]]]:
        gen = random.Random(2)
        out = []
        rates = {name: args.fair_rate for name in light}
        if with_heavy:
            rates["heavy"] = args.fair_rate * args.heavy_x
        for name, rate in rates.items():
            t, k = 0.0, 0
            while True:
                t += gen.expovariate(rate)
                if t > args.duration:
                    break
                ids = _tokens(rng, args.fair_prompt)
                out.append((t, {"request_id": f"{name}-{k}", "prompt_token_ids": ids, "tenant": name}))
                k += 1
        return out

    def light_p99(got: dict[str, Any]) -> float:
        return pct([v for rid, v in got["ttft"].items() if rid.startswith("light-")], 0.99)

    out: dict[str, Any] = {}
    for mode, policy, heavy in (("alone", "fcfs", False), ("fcfs", "fcfs", True), ("fair", "fair", True)):
        got = _run_engine(args, policy, arrivals(heavy), args.gen)
        out[mode] = {
            "light_ttft_p99_s": light_p99(got),
            "requests": len(got["ttft"]),
            "wall_s": got["wall_s"],
        }
        print(mode, out[mode], flush=True)
    alone = out["alone"]["light_ttft_p99_s"]
    out["fair_over_alone"] = out["fair"]["light_ttft_p99_s"] / alone
    out["fcfs_over_alone"] = out["fcfs"]["light_ttft_p99_s"] / alone
    return out


SMOKE = dict(tenants=16, system=512, private=64, rate=8.0, gen=4, light=3, heavy_x=10, fair_rate=2.0)
SMOKE |= dict(duration=3.0, fair_prompt=32, max_num_seqs=8, max_batched_tokens=1024, num_kv_blocks=1024)


def run(args: argparse.Namespace) -> None:
    if args.smoke:
        for k, v in SMOKE.items():
            setattr(args, k, v)
        args.device, args.out = "cpu", str(Path(tempfile.gettempdir()) / NAME)
        args.model = dummy_model(TINY, Path(tempfile.mkdtemp(prefix="tenants-")))
    result: dict[str, Any] = {**run_info(), "settings": {k: v for k, v in vars(args).items() if k != "mode"}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for part, measure in (("salts", salts_part), ("fair", fair_part)):
        if part in args.parts:
            result[part] = measure(args)
            report(result, out)  # each part's results written as it ends


def report(result: dict[str, Any], out: Path) -> None:
    s = result["settings"]
    lines = [
        "# Many tenants on one engine",
        "",
        f"{result['device']}; torch {result['torch']}; commit {result['commit']}; {result['date']}; model "
        f"{s['model']}. Written by `benchmarks/tenants.py` (`{'--smoke' if s.get('smoke') else 'run'}`).",
    ]
    if result.get("salts"):
        r = result["salts"]
        lines += [
            "",
            f"## Salt scope: {s['tenants']} tenants, a {s['system']}-token public system prompt and "
            f"{s['private']} private tokens each, all salted, Poisson arrivals at {s['rate']} req/s",
            "",
            "| scope | prompt tokens computed | TTFT p50 s | TTFT p99 s |",
            "| --- | ---: | ---: | ---: |",
            *[
                f"| {scope} | {r[scope]['prompt_tokens_computed']:,} | {r[scope]['ttft_p50_s']:.3f} "
                f"| {r[scope]['ttft_p99_s']:.3f} |"
                for scope in ("prompt", "after-system")
            ],
            "",
            f"after-system computed {r['computed_over_bound']:.3f} x the bound 1.1 x (system + tenants "
            f"x private) = {r['bound_tokens']:,.0f} tokens (target <= 1); TTFT p50 "
            f"{r['ttft_p50_x']:.2f}x lower than whole-prompt salting (target >= 5).",
        ]
    if result.get("fair"):
        r = result["fair"]
        lines += [
            "",
            f"## Fair shares: one tenant at {s['heavy_x']}x the rate of {s['light']} others "
            f"({s['fair_rate']} req/s each, {s['duration']} s of arrivals, {s['fair_prompt']}-token prompts)",
            "",
            "| run | light tenants' TTFT p99 s | requests |",
            "| --- | ---: | ---: |",
            *[
                f"| {m} | {r[m]['light_ttft_p99_s']:.3f} | {r[m]['requests']} |"
                for m in ("alone", "fcfs", "fair")
            ],
            "",
            f"fair / alone {r['fair_over_alone']:.2f}x (target <= 1.2); fcfs / alone "
            f"{r['fcfs_over_alone']:.2f}x.",
        ]
    write_results(NAME, result, "\n".join(lines) + "\n", out)
    plt = pyplot()
    if plt is None or not result.get("salts"):
        return
    fig, ax = plt.subplots(figsize=(5, 3))
    r = result["salts"]
    ax.bar(["prompt", "after-system"], [r[k]["ttft_p50_s"] for k in ("prompt", "after-system")])
    ax.set_ylabel("TTFT p50 (s)")
    fig.tight_layout()
    fig.savefig(out / f"{NAME}.png", dpi=110)
    plt.close(fig)


def add_run_args(r: argparse.ArgumentParser) -> None:
    r.add_argument("--model", default="dummy:llama-3.1-8b")
    r.add_argument("--device", default="cuda")
    r.add_argument("--parts", nargs="+", default=["salts", "fair"])
    r.add_argument("--smoke", action="store_true", help="the tiny model on the CPU, into a temp dir")
    r.add_argument("--tenants", type=int, default=256)
    r.add_argument("--system", type=int, default=4096)
    r.add_argument("--private", type=int, default=512)
    r.add_argument("--rate", type=float, default=32.0, help="salts: arrivals a second")
    r.add_argument("--gen", type=int, default=32)
    r.add_argument("--light", type=int, default=9)
    r.add_argument("--heavy-x", type=float, default=10.0)
    r.add_argument("--fair-rate", type=float, default=2.0, help="fair: each light tenant's arrivals a second")
    r.add_argument("--duration", type=float, default=30.0, help="fair: seconds of arrivals")
    r.add_argument("--fair-prompt", type=int, default=1024)
    r.add_argument("--max-num-seqs", type=int, default=64)
    r.add_argument("--max-batched-tokens", type=int, default=8192)
    r.add_argument("--num-kv-blocks", type=int, default=0, help="0: the engine's own sizing")


if __name__ == "__main__":
    run_or_report(__doc__, NAME, RESULTS, add_run_args, run, report)
