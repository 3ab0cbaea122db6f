"""Overload: one server with a queue deadline, Poisson chats at its sustainable rate R and at 2R.

Issue 55's target: at 2x the sustainable rate every request is either served within its deadline or
refused with 429/503 at once, no 5xx, and the server's goodput at 2R is >= 0.9 of its goodput at R
(an engine that queues everything serves nobody in time once the queue outgrows the deadline; one
that refuses too eagerly, or spends its steps on requests that then miss, loses goodput).

- one ``prefixserve serve --max-queue-delay D`` (started as a user starts it), loaded by
  ``benchmarks.serving_client`` processes (the official ``openai`` client, streamed chats with
  logprobs so a token counts even where its text is empty, no retries);
- the workload: chats after one shared system prompt (``--system-tokens``), user turns and answers
  uniform in ``--user-tokens`` / ``--output-tokens`` (EOS ignored, greedy), Poisson arrivals;
- R: ``--rate``, or found by a short ladder: a warm-up burst of ``--max-num-seqs`` chats at once gives
  the full batch's request rate C; rates from ``--ladder-start`` x C, x ``--ladder-step`` up while a
  ``--ladder-window`` of arrivals is sustained (down if the first is not), R the highest sustained.
  A rate is **sustained** when >= 95% of its requests are served within their deadline, none got a 5xx;
- then ``--window`` seconds of arrivals at R and at 2R (new chats, the same mix), judged.

Definitions (per request; times on the client, from when it was sent):

- **deadline**: ``D + S x max_tokens`` (``D``: the server's ``--max-queue-delay``; ``S``: ``--slo``,
  seconds per generated token): the time to wait for a start plus a per-token budget for the answer;
- **served within its deadline**: a 200 whose stream ended with its last token (finish_reason
  "length" or "stop") by its deadline (else *served late*);
- **refused**: a 429 (``queue_full`` / ``queue_timeout``, with or without ``Retry-After``) or a 503;
  **at once** when it came within ``--at-once`` seconds (a refusal at arrival takes milliseconds; a
  request admitted and then dropped from the queue at its deadline is refused after ~D s: late);
- **unresolved**: neither served within its deadline nor refused: served late, another 4xx, a 5xx,
  a client timeout (no answer ``--patience`` s past the deadline), a broken stream;
- **goodput**: requests served within their deadline / the window's arrival span (requests / rate).

Verdicts (``benchmarks/overload_report.py``), over the R and 2R windows: zero 5xx (503 refusals
apart), zero unresolved requests, p99 time to a refusal at 2R <= ``--at-once``, and
goodput(2R) / goodput(R) >= 0.9. The server's counters over each window say where refusals were
decided: at arrival in the HTTP process (from the engine's last published queue), at arrival by the
engine (between its steps), or by dropping a waiting request that could not start by its deadline.

Usage (GPU; the defaults, sized for the 8B dummy model on one H100, take ~7 min, start-up included):
    PYTHONPATH=. python -m benchmarks.overload run
    PYTHONPATH=. python -m benchmarks.overload run --rate 20   # R known: no ladder
    python -m benchmarks.overload report --json docs/benchmarks/overload.json
Tiny CPU run (a check that every part works, ~1-2 min; writes overload_cpu.* into a temp dir unless --out):
    PYTHONPATH=. python -m benchmarks.overload run --device cpu
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import RESULTS, TINY, dummy_model, pct, run_info, run_or_report
from benchmarks.harness.server import Clients, ServerProcess, apply_cpu_defaults, serve_command, wait_idle
from benchmarks.harness.text import rendered_tokens
from benchmarks.overload_report import report
from benchmarks.serving_gpu.workload import chat_requests, system_prompt

SUSTAINED = 0.95  # a ladder rate is sustained when this share of its requests is served within deadline
# what --device cpu changes (explicit options still win): the tiny model, sizes that run in ~1-2 min
CPU = dict(
    system_tokens=256,
    user_tokens=[8, 32],
    output_tokens=[8, 16],
    max_queue_delay=1.0,
    slo=0.05,
    window=15.0,
    ladder_window=6.0,
    ladder_points=4,
    warm_requests=None,
    warm_window=5.0,
    max_num_seqs=32,
    num_kv_blocks=1024,
    max_num_batched_tokens=256,
    clients=2,
    at_once=0.5,
    patience=10.0,
    bin_s=1.0,
)
# /metrics counters whose change over a window is recorded (names as ``scrape`` gives them)
COUNTERS = {
    "requests": "requests_total",
    "aborted": "requests_aborted_total",
    "refused_queue_requests": "requests_refused_queue_requests_total",
    "refused_queue_tokens": "requests_refused_queue_tokens_total",
    "refused_deadline": "requests_refused_deadline_total",
    "refused_http": "requests_refused_http_total",  # of the three above, decided in the HTTP process
    "dropped_deadline": "requests_dropped_deadline_total",
    # the admission's wait estimate against the starts (serving/admission.py)
    "wait_starts": "queue_starts_estimated_total",
    "wait_estimated": "queue_wait_estimated_seconds_total",
    "wait_actual": "queue_wait_actual_seconds_total",
    "starts_late": "queue_starts_late_total",
    "generation_tokens": "generation_tokens_total",
    "preemptions": "preemptions_total",
    "http_2xx": "http_2xx",
    "http_4xx": "http_4xx",
    "http_5xx": "http_5xx",
    # where a client's wait goes: the engine's arrival-to-first-token, the HTTP loop's lateness
    "server_ttft_sum": "time_to_first_token_seconds_sum",
    "server_ttft_count": "time_to_first_token_seconds_count",
    "loop_lag_sum": "event_loop_lag_seconds_sum",
    "loop_lag_count": "event_loop_lag_seconds_count",
    "loop_lag_le_1s": "event_loop_lag_seconds_bucket_le_1s",
    "gc_pause_sum": "http_gc_pause_seconds_sum",
    "gc_pause_count": "http_gc_pause_seconds_count",
    "gc_pause_le_1s": "http_gc_pause_seconds_bucket_le_1s",
    "graph_captures": "cuda_graph_captures_total",
    "graph_capture_s": "cuda_graph_capture_seconds_total",
    "graph_misses": "cuda_graph_misses_total",
    "compiles": "kernel_compiles_serving_total",
    "compile_s": "kernel_compile_serving_seconds_total",
    "steps": "steps_total",
    "slow_steps": "slow_steps_total",
    "slow_step_host_s": "slow_step_host_seconds_total",
    "step_s": "step_seconds_total",
    "engine_gc_sum": "engine_gc_pause_seconds_total",
    "engine_send_s": "engine_pipe_send_seconds_total",
    "engine_gc_passes": "engine_gc_passes_total",
    "idle_trim_sum": "http_idle_trim_seconds_sum",
    "idle_trim_count": "http_idle_trim_seconds_count",
    "refusal_le_1s": "refusal_seconds_bucket_le_1s",
    "to_engine_le_1s": "request_to_engine_seconds_bucket_le_1s",
    "intake_le_1s": "request_intake_seconds_bucket_le_1s",
    # the same request's path outside the engine's clock (metrics.PATH_STAGES): route start -> handed
    # to the engine -> the engine's arrival; the engine's first token -> this process -> first write
    **{
        f"{key}_{part}": f"{name}_seconds_{part}"
        for key, name in (
            ("intake", "request_intake"),
            ("to_engine", "request_to_engine"),
            ("from_engine", "first_token_delivery"),
            ("to_client", "first_write"),
            ("refusal", "refusal"),
        )
        for part in ("sum", "count")
    },
}
DROPPED_MARK = "dropped from the queue"  # in the 429 of a request dropped at its deadline after waiting
OUTCOMES = (
    "served",  # within its deadline
    "refused_at_once",
    "refused_late",
    "served_late",
    "http_4xx",
    "http_5xx",
    "client_timeout",
    "error",
)


def add_run_args(r: argparse.ArgumentParser) -> None:
    r.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    r.add_argument("--model", default=None, help="default: dummy:llama-3.1-8b (cuda), the tiny model (cpu)")
    r.add_argument(
        "--name", default=None, help="result file name (default overload, overload_cpu on the CPU)"
    )
    r.add_argument("--rate", type=float, default=None, help="R in requests/s (default: found by the ladder)")
    r.add_argument("--window", type=float, default=60.0, help="seconds of arrivals at R and at 2R")
    r.add_argument("--max-queue-delay", type=float, default=3.0, help="D: the server's --max-queue-delay")
    r.add_argument("--slo", type=float, default=0.1, help="S: seconds per generated token in a deadline")
    r.add_argument("--at-once", type=float, default=1.0, help="a refusal within this many seconds is at once")
    r.add_argument("--patience", type=float, default=30.0, help="seconds past its deadline a client waits")
    r.add_argument("--system-tokens", type=int, default=2048)
    r.add_argument("--user-tokens", type=int, nargs=2, default=[64, 256])
    r.add_argument("--output-tokens", type=int, nargs=2, default=[128, 256])
    r.add_argument("--ladder-window", type=float, default=15.0, help="seconds of arrivals per ladder rate")
    r.add_argument(
        "--warm-window",
        type=float,
        default=40.0,
        help="seconds of arrivals at 2R before the judged windows, not judged: the kernels and graphs "
        "a cold server compiles for new shapes stop it for seconds (0: none)",
    )
    r.add_argument("--ladder-start", type=float, default=0.75, help="first ladder rate, x the burst's rate")
    r.add_argument("--ladder-step", type=float, default=1.25, help="ratio between ladder rates")
    r.add_argument("--ladder-points", type=int, default=4, help="ladder rates at most")
    r.add_argument(
        "--warm-requests", type=int, default=None, help="the warm-up burst's chats (default --max-num-seqs)"
    )
    r.add_argument("--max-num-seqs", type=int, default=256)
    r.add_argument("--num-kv-blocks", type=int, default=16000, help="the pool (16K blocks fit an H100)")
    r.add_argument("--max-num-batched-tokens", type=int, default=2048)
    r.add_argument("--clients", type=int, default=8, help="load generator processes")
    r.add_argument("--bin-s", type=float, default=5.0, help="outcomes over time: seconds of arrivals a bin")
    r.add_argument("--server-timeout", type=float, default=600.0)
    r.add_argument("--server-arg", action="append", default=[], help="one more argument for the server")


# ---- one request, one window ----------------------------------------------------------------------
def deadline_s(args: argparse.Namespace, max_tokens: int) -> float:
    """A request's deadline, in seconds after it was sent (see the module docstring)."""
    return args.max_queue_delay + args.slo * max_tokens


def outcome(r: dict[str, Any], deadline: float, at_once: float) -> str:
    """Which of ``OUTCOMES`` one client record is."""
    status = r.get("status")
    if r["error"] is None and r.get("end") is not None and r.get("finish") in ("length", "stop"):
        return "served" if r["end"] - r["sent"] <= deadline else "served_late"
    if status in (429, 503):
        return "refused_at_once" if r["failed"] - r["sent"] <= at_once else "refused_late"
    if status is not None:
        return "http_5xx" if status >= 500 else "http_4xx"
    if r["error"] == "deadline" or "Timeout" in str(r["error"]):
        return "client_timeout"
    return "error"


def window_stats(
    args: argparse.Namespace, reqs: list[dict[str, Any]], results: list[dict[str, Any]], rate: float
) -> dict[str, Any]:
    """Outcomes, goodput, latencies and refusal times of one window, from the clients' records."""
    limit = {q["i"]: deadline_s(args, q["body"]["max_tokens"]) for q in reqs}
    offset = {q["i"]: q["offset"] for q in reqs}
    span = len(reqs) / rate
    kinds = {r["i"]: outcome(r, limit[r["i"]], args.at_once) for r in results}
    counts = dict.fromkeys(OUTCOMES, 0)
    for kind in kinds.values():
        counts[kind] += 1
    served = [r for r in results if kinds[r["i"]] in ("served", "served_late")]
    refused = [r for r in results if kinds[r["i"]].startswith("refused")]
    ttft = [(r["first"] or r["end"]) - r["sent"] for r in served]
    e2e = [r["end"] - r["sent"] for r in served]
    to_refusal = [r["failed"] - r["sent"] for r in refused]
    # a 429 at arrival (the HTTP gate or the engine's check) or after waiting (dropped from the queue)
    dropped = [r["failed"] - r["sent"] for r in refused if DROPPED_MARK in str(r.get("error"))]
    at_arrival = [r["failed"] - r["sent"] for r in refused if DROPPED_MARK not in str(r.get("error"))]
    retry = [int(r["retry_after"]) for r in refused if str(r.get("retry_after") or "").isdigit()]
    codes: dict[str, int] = {}
    for r in refused:
        key = f"{r['status']} {r.get('code') or '-'}"
        codes[key] = codes.get(key, 0) + 1
    lag = [r["sent"] - r["due"] for r in results if r.get("sent") is not None and r.get("due") is not None]
    bins: dict[str, list[int]] = {
        k: [0] * max(1, math.ceil(span / args.bin_s)) for k in ("served", "refused", "other")
    }
    for i, kind in kinds.items():
        group = "served" if kind == "served" else "refused" if kind.startswith("refused") else "other"
        bins[group][min(len(bins[group]) - 1, int(offset[i] // args.bin_s))] += 1
    bad = [r for r in results if kinds[r["i"]] not in ("served", "refused_at_once", "refused_late")]
    return {
        "rate_req_s": rate,
        "requests": len(reqs),
        "answered": len(results),
        "window_s": span,
        **counts,
        "refused": len(refused),
        "refused_429": sum(r["status"] == 429 for r in refused),
        "refused_429_retry_after": sum(r["status"] == 429 and bool(r.get("retry_after")) for r in refused),
        "refused_503": sum(r["status"] == 503 for r in refused),
        "refusal_codes": codes,
        "unresolved": len(reqs) - counts["served"] - len(refused),
        "error_sample": next((r["error"] for r in bad if r.get("error")), None),
        "goodput_req_s": counts["served"] / span,
        "served_fraction": counts["served"] / max(1, len(reqs)),
        "ttft_p50_s": pct(ttft, 0.5),
        "ttft_p99_s": pct(ttft, 0.99),
        "ttft_mean_s": sum(ttft) / len(ttft) if ttft else float("nan"),  # beside the server's means
        "e2e_p50_s": pct(e2e, 0.5),
        "e2e_p99_s": pct(e2e, 0.99),
        "refusal_s_p50": pct(to_refusal, 0.5),
        "refusal_s_p99": pct(to_refusal, 0.99),
        "refusal_s_max": max(to_refusal, default=float("nan")),
        "refusal_s_mean": sum(to_refusal) / len(to_refusal) if to_refusal else float("nan"),
        "refused_at_arrival": len(at_arrival),
        "refusal_at_arrival_s_p50": pct(at_arrival, 0.5),
        "refusal_at_arrival_s_p99": pct(at_arrival, 0.99),
        # the slowest refusals at arrival, for the record: when in the window, how long, the message
        # (it says the time left when the server decided: arrival or later)
        "slow_refusals_at_arrival": [
            {
                "offset_s": round(offset[r["i"]], 3),
                "s": round(r["failed"] - r["sent"], 3),
                "error": str(r["error"])[:260],
            }
            for r in sorted(refused, key=lambda r: r["sent"] - r["failed"])
            if DROPPED_MARK not in str(r.get("error"))
        ][:8],
        "refused_dropped": len(dropped),
        "refusal_dropped_s_p50": pct(dropped, 0.5),
        "refusal_dropped_s_p99": pct(dropped, 0.99),
        "retry_after_min": min(retry, default=None),
        "retry_after_max": max(retry, default=None),
        "generated_tokens": sum(r["tokens"] for r in served),
        "client_lag_p99_s": pct(lag, 0.99) if lag else 0.0,
        "client_lag_max_s": max(lag, default=0.0),
        "bins": bins,
    }


def run_window(
    args: argparse.Namespace,
    server: ServerProcess,
    clients: Clients,
    tok: Any,
    system: str,
    rate: float | None,
    count: int,
    seed: int,
    label: str,
) -> dict[str, Any]:
    """``count`` chats at ``rate`` (None: all at once) through the clients, with /metrics around them."""
    # logprobs: a chunk per token even where its text is empty (a dummy model's tokens often decode
    # to nothing, and a stream without logprobs sends no chunk for them): the clients' TTFT is the
    # first token's, not the first printable text's
    reqs = chat_requests(tok, system, count, seed, args, rate, logprobs=True, stream=True, tag=label)
    longest = max(deadline_s(args, q["body"]["max_tokens"]) for q in reqs)
    span = reqs[-1]["offset"]
    before = wait_idle(server.url)
    t0 = time.monotonic()
    began = time.strftime("%H:%M:%S")  # wall clock, to read the server log's times against
    answer = clients.run(
        server.url,
        reqs,
        span + longest + args.patience + 5,
        lead=0.5,
        request_timeout=longest + args.patience,
    )
    res = answer["results"]
    wall = time.monotonic() - t0
    after = wait_idle(server.url, timeout=longest + args.patience)
    if rate is None:  # a burst: its request rate over the time to all answers
        ends = [r["end"] for r in res if r["error"] is None and r.get("end") is not None]
        first = min((r["sent"] for r in res if r.get("sent") is not None), default=0.0)
        rate = len(ends) / (max(ends) - first) if ends else 0.0
        stats = window_stats(args, reqs, res, max(rate, 1e-9))
        stats["burst"] = True
    else:
        stats = window_stats(args, reqs, res, rate)
    stats.update(label=label, wall_s=wall, client_loop_lag=answer.get("loop_lag"), began=began)
    stats["server"] = {k: after.get(name, 0.0) - before.get(name, 0.0) for k, name in COUNTERS.items()}
    print(window_line(stats), flush=True)
    return stats


def window_line(s: dict[str, Any]) -> str:
    return (
        f"[{s['label']:>10s}] {s['rate_req_s']:7.2f} req/s, {s['requests']:5d} req: served {s['served']} "
        f"(goodput {s['goodput_req_s']:.2f} req/s), refused {s['refused_at_once']} at once + "
        f"{s['refused_late']} late ({s.get('server', {}).get('refused_http', 0):.0f} decided in HTTP), "
        f"unresolved {s['unresolved']}, 5xx {s['http_5xx']}; TTFT p50 "
        f"{s['ttft_p50_s']:.2f} p99 {s['ttft_p99_s']:.2f} s; refusal p99 {s['refusal_s_p99']:.3f} s; "
        f"client lag p99 {s['client_lag_p99_s']:.3f} s; {s['wall_s']:.0f} s"
    )


def sustained(stats: dict[str, Any]) -> bool:
    return stats["served_fraction"] >= SUSTAINED and stats["http_5xx"] == 0


# ---- the ladder ----------------------------------------------------------------------------------
def find_rate(
    args: argparse.Namespace, server: ServerProcess, clients: Clients, tok: Any, system: str
) -> tuple[float, dict[str, Any]]:
    """R and how it was found: a full-batch burst's rate, then ladder rates up (or down) from a share
    of it until one is not sustained (or is). Every point gets new chats."""
    warm = args.warm_requests or args.max_num_seqs
    burst = run_window(args, server, clients, tok, system, None, warm, 500, "burst")
    points: list[dict[str, Any]] = []
    ladder: dict[str, Any] = {"burst": burst, "points": points}
    rate = round_rate(args.ladder_start * burst["rate_req_s"])
    best: float | None = None
    direction = 0
    for k in range(args.ladder_points):
        count = max(8, round(rate * args.ladder_window))
        point = run_window(args, server, clients, tok, system, rate, count, 600 + k, f"ladder {k}")
        point["sustained"] = ok = sustained(point)
        points.append(point)
        if ok:
            best = max(best or 0.0, rate)
        if direction == 0:
            direction = 1 if ok else -1
        if (direction > 0 and not ok) or (direction < 0 and ok):
            break
        rate = round_rate(rate * args.ladder_step if direction > 0 else rate / args.ladder_step)
    if best is None:  # nothing sustained down to the last rate tried: judge at that rate anyway
        best = min(p["rate_req_s"] for p in points)
        ladder["bound"] = f"none sustained; the lowest rate tried, {best:g}"
    elif direction > 0 and points[-1]["sustained"]:
        ladder["bound"] = f">= {best:g} (out of ladder points)"
    else:
        ladder["bound"] = f"{best:g} sustained, {best * args.ladder_step:g} not"
    return best, ladder


def round_rate(rate: float) -> float:
    """Two significant digits: rates that read well in a table."""
    return float(f"{max(rate, 0.01):.2g}")


# ---- the run -------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> None:
    apply_cpu_defaults(args, sys.argv[1:], CPU)
    tmp = Path(tempfile.mkdtemp(prefix="overload_"))
    if args.model is None:
        args.model = "dummy:llama-3.1-8b" if args.device == "cuda" else dummy_model(TINY, tmp / "tiny")
    name = args.name or ("overload" if args.device == "cuda" else "overload_cpu")
    out_dir = Path(args.out) if args.device == "cuda" or args.out != str(RESULTS) else tmp / "out"
    from prefixserve.model.loader import tokenizer_for

    model_name, tok = tokenizer_for(args.model, progress=False)
    system = system_prompt(tok, args.system_tokens, random.Random(55).randrange(10**6))
    server = ServerProcess(
        serve_command(args, "--max-queue-delay", str(args.max_queue_delay)), tmp / "server.log", "overload"
    )
    result: dict[str, Any] = {
        "benchmark": name,
        "run": run_info(("openai", "fastapi", "uvicorn")),
        "model_name": model_name,
        "settings": {
            **{k: v for k, v in vars(args).items() if k != "mode"},
            "name": name,
            "out": str(out_dir),
            "system_prompt_tokens": rendered_tokens(tok, [{"role": "system", "content": system}]),
            "server_command": " ".join(server.cmd[1:]),
        },
        "windows": {},
    }
    clients = Clients(args.clients)
    t0 = time.monotonic()
    try:
        result["server_start_s"] = server.launch(args.server_timeout)
        print(f"[server] up in {result['server_start_s']:.1f} s: {result['settings']['server_command']}")
        if args.rate is None:
            rate, result["ladder"] = find_rate(args, server, clients, tok, system)
        else:
            rate = args.rate
            warm = args.warm_requests or args.max_num_seqs
            result["warm"] = run_window(args, server, clients, tok, system, None, warm, 500, "burst")
        result["rate_req_s"] = rate
        if args.warm_window > 0:  # the shapes 2R meets compile and capture here, not in a judged window
            count = max(8, round(2 * rate * args.warm_window))
            result["warm_overload"] = run_window(
                args, server, clients, tok, system, 2 * rate, count, 600, "warm 2R"
            )
        for label, mult, seed in (("R", 1, 700), ("2R", 2, 800)):
            count = max(8, round(mult * rate * args.window))
            result["windows"][label] = run_window(
                args, server, clients, tok, system, mult * rate, count, seed, label
            )
    finally:
        clients.close()
        result["exit_code"] = server.terminate()
        result["server_log_tail"] = server.log_tail(20)
        # what stopped the engine while serving: its slow steps and graph captures, with their times
        # (the windows' wall-clock starts are beside them)
        marks = (
            "slow engine step",
            "captured decode graph",
            "captured the dense pieces",
            "while serving in",
            "from the queue for its deadline",
            "first met after the server was ready",
        )
        lines = server.log_path.read_text(errors="replace").splitlines()
        result["server_stalls"] = [line[:240] for line in lines if any(m in line for m in marks)][-120:]
        # each kernel compiled while serving, with the specialisation that was new (its full line)
        result["serve_compiles"] = [line[:2400] for line in lines if "while serving in" in line][-60:]
    result["wall_s"] = time.monotonic() - t0
    report(result, out_dir)


def main() -> None:
    run_or_report(__doc__, "overload", RESULTS, add_run_args, run, report)


if __name__ == "__main__":
    main()
