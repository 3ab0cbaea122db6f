"""Online serving benchmark (RelayAttention §4.3 style) plus the cost of the HTTP server itself.

Questions:
1. With a long shared system prompt and Poisson arrivals, how do throughput and normalised latency
   (end-to-end seconds per generated token) move with the request rate, with sharing on
   (attention=auto + prefix caching) vs off (attention=reference, no prefix caching)?
2. Does the server (HTTP + SSE + engine thread + queues) keep throughput within 10% of the offline
   ``LLM`` API at the same load (the same burst of requests on the same engine)?

The default model on this machine's CPU, synthetic chat-like lengths, seeded. Writes
docs/benchmarks/serving.json, serving.md and serving.png. Run: ``python benchmarks/serving.py``
(``--quick`` for a smoke run).

``--device cuda`` runs the GPU benchmark instead (``benchmarks/serving_gpu/``: the ``prefixserve serve``
CLI in a subprocess, the official ``openai`` client with streaming, RelayAttention's rate sweep with 2K
and 8K pinned system prompts, Hydragen's shared document and n=64 samples, offline vs server), which
writes serving_gpu.{json,md,png}; ``--smoke`` runs that path on the CPU with a tiny model.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import json
import os
import platform
import random
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch

from benchmarks.harness import text
from prefixserve import LLM, SamplingParams
from prefixserve.config import EngineConfig
from prefixserve.entrypoints.openai.server import ServerThread, build_app

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "docs" / "benchmarks"
WORDS = text.WORDS[:33]  # the harness's first 33 words: the published runs' prompts, unchanged


# ---- workload ----------------------------------------------------------------------------------
@dataclass
class Workload:
    system: str
    system_tokens: int
    questions: list[str]
    output_lens: list[int]


def make_system_prompt(tokenizer: Any, target_tokens: int) -> tuple[str, int]:
    rng = random.Random(0)
    parts = ["You are the support assistant of a cycling shop. Follow these house rules."]
    while len(tokenizer.encode(" ".join(parts))) < target_tokens:
        i = len(parts)
        parts.append(
            f"Rule {i}: when asked about the {rng.choice(WORDS)}, mention the {rng.choice(WORDS)} "
            f"and the {rng.choice(WORDS)}, stay polite, and never invent prices."
        )
    text = " ".join(parts)
    return text, len(tokenizer.encode(text))


def make_workload(tokenizer: Any, system_tokens: int, n: int, seed: int) -> Workload:
    """Chat-like lengths: questions of 10-50 words, answers log-normal around 32 tokens (8-64)."""
    system, count = make_system_prompt(tokenizer, system_tokens)
    rng = random.Random(seed)
    questions = [
        f"Question {seed}-{i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 50))) + "?"
        for i in range(n)
    ]
    lens = [max(8, min(64, round(rng.lognormvariate(3.4, 0.5)))) for _ in range(n)]
    return Workload(system, count, questions, lens)


def messages(w: Workload, i: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": w.system}, {"role": "user", "content": w.questions[i]}]


# ---- clients -----------------------------------------------------------------------------------
async def _one(http: httpx.AsyncClient, w: Workload, i: int, stream: bool) -> dict[str, float]:
    body = {
        "model": "default",
        "messages": messages(w, i),
        "max_tokens": w.output_lens[i],
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = None
    if not stream:
        r = await http.post("/v1/chat/completions", json=body)
        r.raise_for_status()
        usage = r.json()["usage"]
    else:
        usage = {}
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    first = time.perf_counter()
                if chunk.get("usage"):
                    usage = chunk["usage"]
    end = time.perf_counter()
    return {
        "start": start,
        "end": end,
        "ttft": (first or end) - start,
        "tokens": usage["completion_tokens"],
        "cached": usage["prompt_tokens_details"]["cached_tokens"],
        "prompt": usage["prompt_tokens"],
    }


async def _poisson(url: str, w: Workload, rate: float, seed: int, stream: bool) -> list[dict[str, float]]:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        tasks = []
        for i in range(len(w.questions)):
            tasks.append(asyncio.create_task(_one(http, w, i, stream)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        return list(await asyncio.gather(*tasks))


def summarize(results: list[dict[str, float]]) -> dict[str, float]:
    span = max(r["end"] for r in results) - min(r["start"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    return {
        "requests": len(results),
        "duration_s": span,
        "throughput_req_s": len(results) / span,
        "throughput_tok_s": tokens / span,
        "norm_latency_s_per_tok": statistics.mean((r["end"] - r["start"]) / r["tokens"] for r in results),
        "mean_latency_s": statistics.mean(r["end"] - r["start"] for r in results),
        "mean_ttft_s": statistics.mean(r["ttft"] for r in results),
        "cached_prompt_fraction": sum(r["cached"] for r in results)
        / max(1, sum(r["prompt"] for r in results)),
    }


# ---- experiments -------------------------------------------------------------------------------
def engine_config(sharing: bool, num_kv_blocks: int) -> EngineConfig:
    return EngineConfig(
        device="cpu",
        attention="auto" if sharing else "reference",
        enable_prefix_caching=sharing,
        num_kv_blocks=num_kv_blocks,
    )


def rate_sweep(args: argparse.Namespace, tokenizer: Any) -> list[dict[str, Any]]:
    rows = []
    for sharing in (True, False):
        app = build_app(engine_config(sharing, args.num_kv_blocks))
        with ServerThread(app) as srv:
            warm = make_workload(tokenizer, args.system_tokens, 4, seed=999)
            asyncio.run(_poisson(srv.url, warm, float("inf"), 0, stream=True))
            for k, rate in enumerate(args.rates):
                w = make_workload(tokenizer, args.system_tokens, args.requests, seed=100 + k)
                t0 = time.perf_counter()
                stats = summarize(asyncio.run(_poisson(srv.url, w, rate, seed=k, stream=True)))
                row = {"sharing": sharing, "rate_req_s": rate, **stats}
                rows.append(row)
                print(
                    f"sharing={'on ' if sharing else 'off'} rate={rate:>4} req/s: "
                    f"{stats['throughput_tok_s']:6.1f} tok/s, {stats['norm_latency_s_per_tok']:.3f} s/tok, "
                    f"ttft {stats['mean_ttft_s']:.2f} s  ({time.perf_counter() - t0:.0f} s)",
                    flush=True,
                )
        del app, srv
        gc.collect()
    return rows


def offline_vs_server(args: argparse.Namespace, tokenizer: Any) -> dict[str, Any]:
    """The same burst on the same engine: LLM.chat on the engine thread vs concurrent HTTP clients."""
    llm = LLM(device="cpu", num_kv_blocks=args.num_kv_blocks, progress=False)
    app = build_app(engine=llm.engine)
    runs: dict[str, list[float]] = {"offline": [], "server": []}

    def offline(w: Workload) -> float:
        params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in w.output_lens]
        convs = [messages(w, i) for i in range(len(w.questions))]
        start = time.perf_counter()
        outs = llm.chat(convs, params)
        elapsed = time.perf_counter() - start
        return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed

    with ServerThread(app) as srv:
        # LLM.chat runs on the engine thread (loop.call), so the Engine is only ever touched there
        warm = make_workload(tokenizer, args.system_tokens, 4, seed=998)
        srv.engine_loop.call(lambda _: offline(warm)).result()
        asyncio.run(_poisson(srv.url, warm, float("inf"), 0, stream=False))
        for rep in range(args.repeats):
            w_off = make_workload(tokenizer, args.system_tokens, args.burst, seed=200 + 2 * rep)
            w_srv = make_workload(tokenizer, args.system_tokens, args.burst, seed=201 + 2 * rep)
            w_srv.output_lens = list(w_off.output_lens)  # the same amount of work
            runs["offline"].append(srv.engine_loop.call(lambda _, w=w_off: offline(w)).result())
            stats = summarize(asyncio.run(_poisson(srv.url, w_srv, float("inf"), 0, stream=False)))
            runs["server"].append(stats["throughput_tok_s"])
            print(
                f"burst {rep}: offline {runs['offline'][-1]:.1f} tok/s, "
                f"server {runs['server'][-1]:.1f} tok/s",
                flush=True,
            )
    best_off, best_srv = max(runs["offline"]), max(runs["server"])
    mean_off, mean_srv = statistics.mean(runs["offline"]), statistics.mean(runs["server"])
    return {
        "burst_requests": args.burst,
        "offline_tok_s": runs["offline"],
        "server_tok_s": runs["server"],
        "best_ratio": best_srv / best_off,
        "mean_ratio": mean_srv / mean_off,
    }


# ---- reporting ---------------------------------------------------------------------------------
def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
        return out.stdout.strip() or "uncommitted (no commit yet)"
    except OSError:
        return "unknown"


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def write_markdown(result: dict[str, Any], path: Path) -> None:
    m, c = result["machine"], result["config"]
    lines = [
        "# Serving benchmark (CPU)",
        "",
        f"{result['date']}, commit {result['commit']}; {m['cpu']} ({m['cpu_count']} cores, "
        f"{m['torch_threads']} torch threads), torch {m['torch']}, Python {m['python']}.",
        "",
        f"Model: {result['model']} (fp32). Workload: a {c['system_tokens']}-token shared system prompt, "
        f"questions of 10-50 words, answers of 8-64 tokens (log-normal, median ~30, `ignore_eos`), greedy; "
        f"{c['requests']} streamed chat requests per rate, Poisson arrivals; one server per configuration "
        "(in-process, loopback HTTP). Sharing on = `attention=auto` + prefix caching; "
        "off = `attention=reference`, `--no-prefix-caching`.",
        "",
        "Normalised latency = mean over requests of end-to-end seconds / generated tokens "
        "(RelayAttention §4.3).",
        "",
        "| sharing | rate (req/s) | throughput (req/s) | throughput (tok/s) | norm. latency (s/tok) "
        "| mean TTFT (s) | cached prompt |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rate_sweep"]:
        lines.append(
            f"| {'on' if r['sharing'] else 'off'} | {r['rate_req_s']:g} | {r['throughput_req_s']:.2f} "
            f"| {r['throughput_tok_s']:.1f} | {r['norm_latency_s_per_tok']:.3f} | {r['mean_ttft_s']:.2f} "
            f"| {r['cached_prompt_fraction']:.0%} |"
        )
    ov = result["offline_vs_server"]
    lines += [
        "",
        f"## Server vs offline API ({ov['burst_requests']}-request burst, same engine, sharing on)",
        "",
        "Generated tokens per second for the same burst: `LLM.chat` (run on the engine thread) vs "
        f"{ov['burst_requests']} concurrent non-streamed HTTP chat requests; alternated, "
        f"{len(ov['offline_tok_s'])} repeats.",
        "",
        "| run | offline (tok/s) | server (tok/s) |",
        "|---:|---:|---:|",
    ]
    for i, (a, b) in enumerate(zip(ov["offline_tok_s"], ov["server_tok_s"], strict=True)):
        lines.append(f"| {i} | {a:.1f} | {b:.1f} |")
    lines += [
        "",
        f"Server / offline: **{ov['best_ratio']:.1%}** (best of each), {ov['mean_ratio']:.1%} (means); "
        f"target >= 90%: {'met' if ov['best_ratio'] >= 0.9 else 'NOT met'}.",
        "",
        f"Whole run: {result['wall_s']:.0f} s. Reproduce: `python benchmarks/serving.py`.",
    ]
    if result.get("note"):
        lines += ["", result["note"]]
    path.write_text("\n".join(lines) + "\n")


def plot(result: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for sharing, style in ((True, "o-"), (False, "s--")):
        rows = [r for r in result["rate_sweep"] if r["sharing"] is sharing]
        label = "sharing on (auto + prefix cache)" if sharing else "sharing off (reference, no cache)"
        rates = [r["rate_req_s"] for r in rows]
        axes[0].plot(rates, [r["throughput_tok_s"] for r in rows], style, label=label)
        axes[1].plot(rates, [r["norm_latency_s_per_tok"] for r in rows], style, label=label)
    axes[0].set(xlabel="request rate (req/s)", ylabel="throughput (generated tok/s)", xscale="log")
    axes[1].set(xlabel="request rate (req/s)", ylabel="normalised latency (s/token)", xscale="log")
    rates = result["config"]["rates"]
    for ax in axes:
        ax.set_xticks(rates, [f"{r:g}" for r in rates])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"prefixserve server, {result['model']} on CPU, "
        f"{result['config']['system_tokens']}-token system prompt"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> None:
    # --device cuda (or --smoke, or --part): the GPU benchmark through the real server (serving_gpu/)
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    first.add_argument("--smoke", action="store_true")
    first.add_argument("--part", default=None)
    known, _ = first.parse_known_args()
    if known.device == "cuda" or known.smoke or known.part:
        import sys

        sys.path.insert(0, str(ROOT))
        from benchmarks import serving_gpu

        serving_gpu.main(sys.argv[1:])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="cuda: the GPU benchmark through `prefixserve serve` (benchmarks/serving_gpu/; "
        "its options: --device cuda --help)",
    )
    p.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 2.0, 4.0])
    p.add_argument("--requests", type=int, default=10, help="requests per rate")
    p.add_argument("--system-tokens", type=int, default=600)
    p.add_argument("--burst", type=int, default=24, help="requests in the offline-vs-server burst")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--num-kv-blocks", type=int, default=1280)
    p.add_argument("--note", default="", help="a remark written into the report (e.g. machine load)")
    p.add_argument("--quick", action="store_true", help="tiny smoke run (results not written)")
    args = p.parse_args()
    if args.quick:
        args.rates, args.requests, args.burst, args.repeats, args.system_tokens = [2.0], 4, 4, 1, 200
    start = time.perf_counter()
    llm_tok = LLM(device="cpu", num_kv_blocks=16, progress=False)
    tokenizer, model = llm_tok.get_tokenizer(), llm_tok.engine.model_name
    del llm_tok
    gc.collect()
    comparison = offline_vs_server(args, tokenizer)
    gc.collect()
    sweep = rate_sweep(args, tokenizer)
    result = {
        "benchmark": "serving",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "commit": git_commit(),
        "machine": machine(),
        "model": model,
        "config": {
            "rates": args.rates,
            "requests": args.requests,
            "system_tokens": make_system_prompt(tokenizer, args.system_tokens)[1],
            "burst": args.burst,
            "repeats": args.repeats,
            "num_kv_blocks": args.num_kv_blocks,
        },
        "rate_sweep": sweep,
        "offline_vs_server": comparison,
        "wall_s": time.perf_counter() - start,
        "note": args.note,
    }
    if args.quick:
        print(json.dumps(result, indent=2))
        return
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / "serving.json").write_text(json.dumps(result, indent=2) + "\n")
    write_markdown(result, OUT_DIR / "serving.md")
    plotted = plot(result, OUT_DIR / "serving.png")
    print(f"wrote {OUT_DIR / 'serving.json'}, serving.md{', serving.png' if plotted else ''}")


if __name__ == "__main__":
    main()
