"""Two source trees side by side in one run: the same decode points on an old tree and a new one.

A restructuring must keep every number (issue 101: the 16K grid's B=256 and B=1024 points within
2%). Each measurement runs in a process of its own whose imports come from one tree
(``PYTHONPATH=TREE``, ``benchmarks.decode_run.measure`` of that tree: a warm-up run of the same shape,
then the timed decode), old and new alternating point by point and repeat by repeat, so drift in the
GPU's clocks or the host falls on both alike. Reported per point: each tree's median tok/s over the
repeats and new / old.

    PYTHONPATH=. python -m benchmarks.tree_ab run --old /tmp/old --new . [--model dummy:llama-3.1-8b]
        [--batches 256 1024] [--prefixes 16384] [--repeats 2] [--out docs/benchmarks]
    python -m benchmarks.tree_ab report --json docs/benchmarks/tree_ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.harness import RESULTS, pyplot, run_info
from benchmarks.harness.output import run_or_report, write_json, write_text

NAME = "tree_ab"

# run inside the measured tree: its own decode_run and engine
MEASURE = """
import json, sys
from benchmarks.decode_run import measure, shared_prompts
model, b, p, own, gen = sys.argv[1], *map(int, sys.argv[2:6])
prompts = (shared_prompts(b, p, own, seed=0), shared_prompts(b, p, own, seed=1))
got = measure(model, "cuda", "auto", prompts, gen)
print("RESULT " + json.dumps({k: got[k] for k in ("tok_s", "host_overhead_frac", "preemptions")}))
"""


def commit_of(tree: Path) -> str:
    """The tree's commit (``PREFIXSERVE_COMMIT`` where it is a copy without git), plus ``+dirty``."""
    try:
        git = ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"]
        head = subprocess.run(git, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return (tree / "COMMIT").read_text().strip() if (tree / "COMMIT").is_file() else "unknown"
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain"], capture_output=True, text=True)
    return head + ("+dirty" if dirty.stdout.strip() else "")


def measure_in(tree: Path, args: argparse.Namespace, b: int, p: int) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    cmd = [sys.executable, "-c", MEASURE, args.model, str(b), str(p), str(args.own), str(args.gen)]
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"measuring in {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def run(args: argparse.Namespace) -> None:
    trees = {"old": Path(args.old), "new": Path(args.new)}
    result: dict[str, Any] = {
        **run_info(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("mode", "out")},
        "commits": {name: commit_of(tree) for name, tree in trees.items()},
        "rows": [],
    }
    out = Path(args.out)
    for b in args.batches:
        for p in args.prefixes:
            row: dict[str, Any] = {"B": b, "P": p, "old": [], "new": []}
            for r in range(args.repeats):
                order = ("old", "new") if r % 2 == 0 else ("new", "old")
                for name in order:
                    row[name].append(measure_in(trees[name], args, b, p))
                    print(b, p, name, row[name][-1], flush=True)
            row["old_tok_s"] = statistics.median(m["tok_s"] for m in row["old"])
            row["new_tok_s"] = statistics.median(m["tok_s"] for m in row["new"])
            row["new_over_old"] = row["new_tok_s"] / row["old_tok_s"]
            result["rows"].append(row)
            write_json(out / f"{NAME}.json", result)  # a cut-short run keeps what it measured
    report(result, out)


def report(result: dict[str, Any], out: Path) -> None:
    commits = result["commits"]
    s = result["settings"]
    lines = [
        "# Old tree against new: the same decode points, one run",
        "",
        f"{result['device']}; torch {result['torch']}; {result['date']}; {s['model']}, dummy weights, bf16; "
        f"own {s['own']} tokens per prompt, {s['gen']} generated; {s['repeats']} repeats a tree, "
        "alternating. "
        f"Old: {commits['old']}; new: {commits['new']}. Written by `benchmarks/tree_ab.py`.",
        "",
        "| B | P | old tok/s | new tok/s | new / old |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['B']} | {row['P']} | {row['old_tok_s']:,.0f} | {row['new_tok_s']:,.0f} | "
            f"{row['new_over_old']:.3f} |"
        )
    write_text(out, f"{NAME}.md", lines)
    plt = pyplot()
    if plt is None:
        return
    rows = result["rows"]
    labels = [f"B={r['B']}\nP={r['P']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    ax.bar([i - 0.2 for i in x], [r["old_tok_s"] for r in rows], width=0.4, label=f"old {commits['old']}")
    ax.bar([i + 0.2 for i in x], [r["new_tok_s"] for r in rows], width=0.4, label=f"new {commits['new']}")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("decode tok/s")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"{NAME}.png", dpi=120)
    plt.close(fig)


def add_run_args(r: argparse.ArgumentParser) -> None:
    r.add_argument("--old", required=True, help="the old tree (a checkout or an unpacked archive)")
    r.add_argument("--new", default=".", help="the new tree")
    r.add_argument("--model", default="dummy:llama-3.1-8b")
    r.add_argument("--batches", type=int, nargs="+", default=[256, 1024])
    r.add_argument("--prefixes", type=int, nargs="+", default=[16384])
    r.add_argument("--own", type=int, default=64)
    r.add_argument("--gen", type=int, default=128)
    r.add_argument("--repeats", type=int, default=2)


if __name__ == "__main__":
    run_or_report(__doc__, NAME, RESULTS, add_run_args, run, report)
