"""Probe: why a JSON-schema step still waits for its mask, and which fill policy hides it.

Runs ``benchmarks/structured.py``'s workload (B chat rows, the same schema, T tokens, launched ahead)
on ``--model`` and reports two things:

- **Engine order** (interleaved runs: unconstrained, constrained, constrained with the tokens taken
  late): each run's wall time, the engine thread's wait for the matcher process's answer (median and
  mean: a few long waits are the cost), how often the answer was already there, and the window the
  child had (from the fill's send to the sampling that needs it). "late" forces the order a GPU-bound
  step takes (``ModelRunner.device_idle`` answering False): the tokens waited for after the next
  forward is issued, not as soon as their sampling is out (``Engine._take_tokens``).
- **Fill policies**: the matcher process's messages of one constrained run (free whitespace and
  compact) are recorded and replayed here through a ``Matchers`` of each policy: one thread, always
  xgrammar's threads, and ``FillThreads``' own (threads after a slow fill). Per policy: the child's
  step time (accept + fill) mean / p50 / p90 / max, and its mean excess over the engine's window.

    PYTHONPATH=. python -m benchmarks.probes.structured_waits --device cuda \\
        --model dummy:PATH/config.json [--batch 64] [--tokens 64] [--rounds 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import run_info
from benchmarks.structured import SCHEMA, _conversations


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


class Watch:
    """Wrappers on one engine: the fill's send time, the wait for its answer, the early takes."""

    def __init__(self, llm: Any) -> None:
        self.engine, self.runner = llm.engine, llm.engine.runner
        self.sd = self.engine._structured()
        self.idle = self.runner.device_idle
        self.messages: list[tuple] = []
        self.sent: float | None = None
        self.windows: list[float] = []
        self.waits: list[float] = []
        self.ready = 0
        matchers = self.sd.matchers
        send, step, rows = matchers._send, matchers.step, matchers.rows

        def send_w(message: tuple, slots: Any = None) -> None:
            self.messages.append(message)
            send(message, slots)

        def step_w(accepts: Any, fill: Any) -> None:
            step(accepts, fill)
            if fill is not None:
                self.sent = time.perf_counter()

        def rows_w() -> list[int]:
            started = time.perf_counter()
            if self.sent is not None:
                self.windows.append(started - self.sent)
            self.ready += bool(matchers._conn.poll(0))
            answer = rows()
            self.waits.append(time.perf_counter() - started)
            return answer

        matchers._send, matchers.step, matchers.rows = send_w, step_w, rows_w

    def reset(self, late: bool) -> None:
        self.runner.device_idle = (lambda: False) if late else self.idle
        self.messages.clear()
        self.windows.clear()
        self.waits.clear()
        self.ready, self.sent = 0, None


def engine_order(llm: Any, watch: Watch, batch: int, tokens: int, rounds: int) -> dict[str, Any]:
    """Interleaved runs of each mode; walls, waits and windows per run."""
    from prefixserve import SamplingParams, StructuredOutputs

    convs = _conversations(batch)
    spec = StructuredOutputs(json=SCHEMA)
    free = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=tokens, structured_outputs=spec)
    llm.chat(convs, constrained)  # compiled, matchers warm
    llm.chat(convs, free)
    runs: dict[str, list[dict[str, float]]] = {"unconstrained": [], "early": [], "late": []}
    for _ in range(rounds):
        for mode in runs:
            watch.reset(late=mode == "late")
            started = time.perf_counter()
            llm.chat(convs, free if mode == "unconstrained" else constrained)
            wall = time.perf_counter() - started
            waits, windows = watch.waits, watch.windows
            runs[mode].append({
                "wall_ms": wall * 1e3,
                "wait_median_ms": statistics.median(waits) * 1e3 if waits else 0.0,
                "wait_mean_ms": statistics.fmean(waits) * 1e3 if waits else 0.0,
                "answer_ready": watch.ready / max(1, len(waits)),
                "window_median_ms": statistics.median(windows) * 1e3 if windows else 0.0,
            })  # fmt: skip
    watch.reset(late=False)
    best = {mode: min(r["wall_ms"] for r in rs) for mode, rs in runs.items()}
    ratios = {mode: best["unconstrained"] / best[mode] for mode in ("early", "late")}
    return {"runs": runs, "best_wall_ms": best, "ratio_best": ratios}


def record(llm: Any, watch: Watch, batch: int, tokens: int) -> dict[str, list[tuple]]:
    """The matcher process's step messages of one constrained run, free whitespace and compact."""
    from prefixserve import SamplingParams, StructuredOutputs

    convs, out = _conversations(batch), {}
    for name, compact in (("json", False), ("compact", True)):
        spec = StructuredOutputs(json=SCHEMA, disable_any_whitespace=compact)
        params = SamplingParams(temperature=0, max_tokens=tokens, structured_outputs=spec)
        llm.chat(convs, params)
        watch.reset(late=False)
        llm.chat(convs, params)
        out[name] = (spec, [m for m in watch.messages if m[0] == "step"])
    return out


def replay(setup: tuple, recorded: dict[str, Any], window_ms: float, repeats: int) -> list[dict[str, Any]]:
    """Each recorded run through a fresh ``Matchers`` of each fill policy, the child's steps timed."""
    from prefixserve.structured.matcher_process import Matchers

    rows = []
    for _ in range(repeats):
        for policy in ("one thread", "threads", "adaptive"):
            for name, (spec, steps) in recorded.items():
                matchers = Matchers(setup[1], setup[2], setup[3])
                fills = matchers.fills
                if policy == "one thread":
                    fills.SLOW_SECONDS, fills.FANOUT_ROWS = float("inf"), 1 << 30
                elif policy == "threads":
                    fills.FANOUT_ROWS = 0
                most = max((m[4][2] for m in steps if m[4] is not None), default=1)
                matchers.slots = torch.zeros(2, most, -(-setup[2] // 32), dtype=torch.int32)
                matchers.grammar(spec)
                times = []
                for message in steps:
                    started = time.perf_counter()
                    matchers.step(*message[1:])
                    times.append((time.perf_counter() - started) * 1e3)
                times = times[1:]  # the first makes every matcher
                rows.append({
                    "policy": policy, "whitespace": "free" if name == "json" else "compact",
                    "mean_ms": statistics.fmean(times), "p50_ms": _pct(times, 0.5),
                    "p90_ms": _pct(times, 0.9), "max_ms": max(times),
                    "past_window_ms": statistics.fmean(max(0.0, t - window_ms) for t in times),
                })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    from prefixserve import LLM

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    llm = LLM(
        model=args.model, device=args.device, dtype=dtype, max_num_seqs=args.batch,
        enable_prefix_caching=False, async_scheduling=True, progress=False,
    )  # fmt: skip
    watch = Watch(llm)
    order = engine_order(llm, watch, args.batch, args.tokens, args.rounds)
    for mode, runs in order["runs"].items():
        for r in runs:
            print(
                f"{mode:13s} wall {r['wall_ms']:7.1f} ms  wait median {r['wait_median_ms']:.3f} mean "
                f"{r['wait_mean_ms']:.3f} ms  ready {r['answer_ready']:.2f}  "
                f"window {r['window_median_ms']:.3f} ms"
            )
    print("best-of ratios to unconstrained:", {k: round(v, 3) for k, v in order["ratio_best"].items()})
    window = statistics.median(r["window_median_ms"] for r in order["runs"]["early"])
    fills = replay(watch.sd.matchers._setup, record(llm, watch, args.batch, args.tokens), window, 2)
    print(f"\nthe child's step replayed (accept + fill), ms; past: its excess over a {window:.2f} ms window")
    for r in fills:
        print(
            f"{r['policy']:10s} {r['whitespace']:7s} mean {r['mean_ms']:.3f} p50 {r['p50_ms']:.3f} "
            f"p90 {r['p90_ms']:.3f} max {r['max_ms']:.3f} past {r['past_window_ms']:.3f}"
        )
    if args.json:
        result = {"info": run_info(()), "model": args.model, "batch": args.batch, "tokens": args.tokens,
                  "engine_order": order, "window_ms": window, "fill_policies": fills}  # fmt: skip
        Path(args.json).write_text(json.dumps(result, indent=1))
    llm.shutdown()


if __name__ == "__main__":
    main()
