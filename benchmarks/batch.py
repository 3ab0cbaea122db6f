"""Offline batches (BatchLLM's microbenchmarks): ``schedule="batch"`` against the online scheduler.

Each point has requests in groups of ``degree``: a group shares a P-token prefix, each request adds D
distinct tokens and generates ``gen`` tokens (EOS ignored); the request list is shuffled so a group's
members are far apart, as in an unsorted offline job. Modes, one engine, same settings:
``online`` (continuous batching with the prefix cache: the vLLM-like mode), ``batch`` (first-level
grouping, Algorithm 1: the default) and ``batch_tree`` (the tree's own first level, deeper sharing
left to the prefix cache). Throughput = requests / wall time of ``generate``; token saving (Eq. 1) =
1 - prompt tokens run through the model / prompt tokens (recomputation after preemption counts), beside
the plan's first-level optimum and the full tree's.

    python -m benchmarks.batch run                         # H200: dummy Llama-3.1-8B, the paper's grid
    python -m benchmarks.batch run --device cpu --scale 0.1 --requests 64 --gen 10 --model default
    python -m benchmarks.batch report --json docs/benchmarks/batch.json
    python -m benchmarks.batch run --requests 800 --settings 2000/200 --degrees 4 8 16 --max-num-seqs 32 \
        --num-kv-blocks 6000 --warm-each --order online batch --name batch_pressure   # a pool under pressure
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import RESULTS, pyplot, run_info, write_text
from prefixserve import LLM, SamplingParams
from prefixserve.scheduler.offline import plan_batch

SETTINGS = [(2000, 200), (2000, 1000), (1000, 1000)]  # (shared prefix, distinct) tokens, BatchLLM Fig. 6
MODES = {
    "online": ("online", "first_level"),
    "batch": ("batch", "first_level"),
    "batch_tree": ("batch", "tree"),
}
SHORT = {"online": "online", "batch": "batch", "batch_tree": "tree"}  # report column names


def dataset(
    seed: int, requests: int, degree: int, prefix: int, distinct: int, instruction: int = 0, sub: int = 0
) -> list[list[int]]:
    """``requests`` prompts in groups of ``degree`` sharing a ``prefix``-token head; shuffled.

    Multi-level data (BatchLLM's snippet task): an ``instruction`` every prompt starts with, and a
    ``sub``-token sub-prefix shared by each 4 members of a group (the first ``sub`` distinct tokens)."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1000, 30000) for _ in range(n)]

    common = tokens(instruction)
    prompts = []
    for _ in range(requests // degree):
        head = common + tokens(prefix)
        for k in range(degree):
            if k % 4 == 0:
                shared_sub = tokens(min(sub, distinct))
            prompts.append(head + shared_sub + tokens(distinct - len(shared_sub)))
    rng.shuffle(prompts)
    return prompts


def measure(llm: LLM, prompts: list[list[int]], gen: int, mode: str) -> dict[str, Any]:
    schedule, grouping = MODES[mode]
    params = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
    before = llm.metrics()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    batch = [{"prompt_token_ids": p} for p in prompts]
    outs = llm.generate(batch, params, schedule=schedule, grouping=grouping)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    after = llm.metrics()
    computed = after["prompt_tokens_computed_total"] - before["prompt_tokens_computed_total"]
    logical = sum(map(len, prompts))
    generated = sum(len(o.outputs[0].token_ids) for o in outs)

    def delta(key: str) -> float:
        return round(after.get(key, 0) - before.get(key, 0), 4)

    return {
        "steps": delta("steps_total"),
        "gpu_busy_s": delta("gpu_busy_seconds_total"),
        "gpu_idle_s": delta("gpu_idle_seconds_total"),
        "kv_read_tokens": delta("attention_kv_tokens_read_total"),
        "shared_segments": delta("shared_segments_total"),
        "seconds": round(seconds, 3),
        "req_s": round(len(prompts) / seconds, 3),
        "tok_s": round((logical + generated) / seconds, 1),
        "saving": round(1 - computed / logical, 4),
        "preemptions": after.get("preemptions_total", 0) - before.get("preemptions_total", 0),
        "tokens": [o.outputs[0].token_ids for o in outs],
    }


def flush_prefix_cache(llm: LLM) -> None:
    """Drop every cached block (the engine is idle): take all free blocks and give them back."""
    pool = llm.engine.pool
    pool.release(pool.allocate(pool.num_free))


def run(args: argparse.Namespace) -> None:
    device = args.device
    llm = LLM(
        model=None if args.model == "default" else args.model,
        dtype="bfloat16" if device == "cuda" else "float32",
        device=device,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_kv_blocks=args.num_kv_blocks,
        progress=False,
    )
    chosen = [tuple(int(x) for x in s.split("/")) for s in args.settings] if args.settings else SETTINGS
    settings = [(max(1, round(p * args.scale)), max(1, round(d * args.scale))) for p, d in chosen]
    warm = dataset(99, min(16, args.requests), 2, settings[0][0], settings[0][1])
    for mode in MODES:  # compile, capture graphs, warm the allocator
        measure(llm, warm, 2, mode)
    rows = []
    seed = 0
    for prefix, distinct in settings:
        for degree in args.degrees:
            seed += 1
            prompts = dataset(seed, args.requests, degree, prefix, distinct, args.instruction, args.sub)
            plan = plan_batch(prompts).analysis
            row: dict[str, Any] = {
                "prefix": prefix,
                "distinct": distinct,
                "degree": degree,
                "requests": len(prompts),
                "first_level_optimum": round(plan.first_level_saving, 4),
                "optimal": round(plan.optimal_saving, 4),
            }
            if args.warm_each:  # the point's own shapes compiled and captured before anything is timed
                flush_prefix_cache(llm)
                measure(llm, prompts, args.gen, args.order[-1])
            results = {}
            for mode in args.order:
                flush_prefix_cache(llm)  # no mode finds another's prefixes in the cache
                results[mode] = measure(llm, prompts, args.gen, mode)
            base = results["online"]
            for mode, r in sorted(results.items(), key=lambda kv: list(MODES).index(kv[0])):
                keys = (
                    "seconds",
                    "req_s",
                    "tok_s",
                    "saving",
                    "preemptions",
                    "steps",
                    "gpu_busy_s",
                    "gpu_idle_s",
                    "kv_read_tokens",
                    "shared_segments",
                )
                row.update({f"{mode}_{key}": r[key] for key in keys})
                if mode != "online":
                    row[f"{mode}_x"] = round(r["req_s"] / base["req_s"], 3)
                    same = sum(a == b for a, b in zip(r["tokens"], base["tokens"], strict=True))
                    row[f"{mode}_same_greedy"] = round(same / len(prompts), 4)
            print({k: v for k, v in row.items()}, flush=True)
            rows.append(row)
            _save(args, llm, rows)  # after every point: a run cut short keeps what it measured
    report(*_save(args, llm, rows))


def _save(args: argparse.Namespace, llm: LLM, rows: list[dict[str, Any]]) -> tuple[dict[str, Any], Path]:
    payload = {
        **run_info(),
        "model": args.model,
        "gen": args.gen,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "num_kv_blocks": llm.engine.pool.num_blocks,
        "block_size": llm.engine.config.block_size,
        "order": args.order,
        "warm_each": args.warm_each,
        "instruction": args.instruction,
        "sub": args.sub,
        **({"name": args.name} if args.name else {}),
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    old = out / f"{_name(payload)}.json"
    if args.merge and old.exists():  # a grid too long for one run, in parts: keep the other settings

        def key(r: dict[str, Any]) -> tuple[int, int, int]:
            return r["prefix"], r["distinct"], r["degree"]

        done = {key(r) for r in rows}
        kept = [r for r in json.loads(old.read_text())["rows"] if key(r) not in done]
        payload["rows"] = sorted(kept + rows, key=lambda r: (-r["prefix"], r["distinct"], r["degree"]))
    (out / f"{_name(payload)}.json").write_text(json.dumps(payload, indent=1) + "\n")
    return payload, out


def _name(payload: dict[str, Any]) -> str:
    if payload.get("name"):
        return str(payload["name"])
    return "batch_cpu" if str(payload["device"]).startswith("cpu") else "batch"


def report(payload: dict[str, Any], out: Path) -> None:
    name = _name(payload)
    modes = [m for m in MODES if all(f"{m}_req_s" in r for r in payload["rows"])]  # those run
    lines = [
        '# Offline batches: schedule="batch" vs the online scheduler',
        "",
        f"{payload['device']}; torch {payload['torch']}; commit {payload['commit']}; {payload['date']}; "
        f"model {payload['model']}; {payload['gen']} generated tokens (EOS ignored); max_num_seqs "
        f"{payload['max_num_seqs']}, {payload['max_num_batched_tokens']} tokens a step, "
        f"{payload['num_kv_blocks']} KV blocks of {payload['block_size']}. "
        + (
            f"Every prompt starts with a {payload['instruction']}-token instruction. "
            if payload.get("instruction")
            else ""
        )
        + (
            f"Each 4 members of a group share a {payload['sub']}-token sub-prefix. "
            if payload.get("sub")
            else ""
        )
        + "Inputs shuffled. Modes run in the "
        f"order {', '.join(payload.get('order', list(MODES)))} at each point; "
        + (
            "each point run once untimed first. "
            if payload.get("warm_each")
            else "no untimed run of each point first "
            "(the first mode timed pays its compiles and graph captures). "
        )
        + "Written by `benchmarks/batch.py`.",
        "",
        "| P/D | degree | "
        + " | ".join(f"{m} req/s" for m in modes)
        + " | "
        + " | ".join(f"{SHORT[m]} / online" for m in modes[1:])
        + " | "
        + " | ".join(f"saving {SHORT[m]}" for m in modes)
        + " | first-level optimum | full tree |",
        "| --- | ---: | " + " | ".join(["---:"] * (3 * len(modes) + 1)) + " |",
    ]
    for r in payload["rows"]:
        lines.append(
            f"| {r['prefix']}/{r['distinct']} | {r['degree']} | "
            + " | ".join(f"{r[m + '_req_s']:.2f}" for m in modes)
            + " | "
            + " | ".join(f"{r[m + '_x']:.2f}x" for m in modes[1:])
            + " | "
            + " | ".join(f"{r[m + '_saving']:.1%}" for m in modes)
            + f" | {r['first_level_optimum']:.1%} | {r['optimal']:.1%} |"
        )
    if all("online_gpu_busy_s" in r for r in payload["rows"]):
        lines += [
            "",
            "Where the time goes (per mode: steps, GPU busy seconds, KV rows read by attention, shared "
            "segments attended):",
            "",
            "| P/D | degree | mode | steps | GPU busy s | GPU idle s | KV rows read | shared segments |",
            "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in payload["rows"]:
            for m in modes:
                lines.append(
                    f"| {r['prefix']}/{r['distinct']} | {r['degree']} | {m} | {r[m + '_steps']:.0f} "
                    f"| {r[m + '_gpu_busy_s']:.2f} | {r[m + '_gpu_idle_s']:.2f} "
                    f"| {r[m + '_kv_read_tokens'] / 1e6:.0f}M | {r[m + '_shared_segments']:.0f} |"
                )
    ratios = [r["batch_x"] for r in payload["rows"]]
    high = [r["batch_x"] for r in payload["rows"] if r["degree"] >= 4]
    gaps = [r["first_level_optimum"] - r["batch_saving"] for r in payload["rows"]]
    lines += [
        "",
        f"batch / online: {min(ratios):.2f}-{max(ratios):.2f}x over all points; "
        f"{min(high, default=0):.2f}-{max(high, default=0):.2f}x at sharing degree >= 4. "
        f"Saving below the first-level optimum by at most {max(gaps):.1%} (block granularity: a prefix "
        "shares whole blocks only).",
    ]
    write_text(out, f"{name}.md", lines)
    plot(payload, out / f"{name}.png")


def plot(payload: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    settings = sorted({(r["prefix"], r["distinct"]) for r in payload["rows"]})
    for (prefix, distinct), color in zip(settings, ("C0", "C1", "C2", "C3"), strict=False):
        rows = [r for r in payload["rows"] if (r["prefix"], r["distinct"]) == (prefix, distinct)]
        degrees = [r["degree"] for r in rows]
        label = f"{prefix}/{distinct}"
        axes[0].plot(degrees, [r["batch_req_s"] for r in rows], "-o", color=color, label=f"batch {label}")
        axes[0].plot(degrees, [r["online_req_s"] for r in rows], "--x", color=color, label=f"online {label}")
        axes[1].plot(degrees, [r["batch_saving"] for r in rows], "-o", color=color, label=f"batch {label}")
        axes[1].plot(degrees, [r["online_saving"] for r in rows], "--x", color=color, label=f"online {label}")
    for ax, title in zip(axes, ("throughput (requests/s)", "prompt-token saving (Eq. 1)"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sharing degree")
        ax.set_title(title)
        ax.legend(fontsize=6)
    fig.suptitle(f"{payload['model']} on {payload['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_run_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="dummy:llama-3.1-8b", help="'default' for SmolLM2-135M")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--degrees", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--gen", type=int, default=100)
    ap.add_argument("--scale", type=float, default=1.0, help="scale the prefix/distinct lengths")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--settings", nargs="+", default=None, help="PREFIX/DISTINCT pairs (default: paper's)")
    ap.add_argument("--merge", action="store_true", help="keep the existing JSON's rows of other settings")
    ap.add_argument("--instruction", type=int, default=0, help="tokens every prompt starts with")
    ap.add_argument("--sub", type=int, default=0, help="sub-prefix tokens of each 4 group members")
    ap.add_argument(
        "--warm-each",
        action="store_true",
        help="run each point once untimed first (else the first mode timed pays its compiles)",
    )
    ap.add_argument(
        "--order",
        nargs="+",
        default=list(MODES),
        choices=list(MODES),
        help="the modes run at each point, in this order (to see run-order effects); "
        "online and batch at least",
    )
    ap.add_argument(
        "--name",
        default=None,
        help="file name of the results, without suffix (default: batch, or batch_cpu on the CPU)",
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", default=str(RESULTS))
    add_run_args(r)
    p = sub.add_parser("report", help="rewrite the Markdown and plot from a JSON written by run")
    p.add_argument("--json", required=True)
    args = ap.parse_args()
    if args.mode == "run":
        if not {"online", "batch"} <= set(args.order) or len(set(args.order)) != len(args.order):
            ap.error("--order: each mode once, online and batch among them")
        run(args)
    else:
        path = Path(args.json)
        report(json.loads(path.read_text()), path.parent)


if __name__ == "__main__":
    main()
