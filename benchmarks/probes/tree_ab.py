"""Whole decode steps of two source trees in one call: this checkout against a base tree, alternating.

A change that has no switch (it moves work from one kernel into another, and the code around both
assumes it) is measured by running the engine from each tree in a fresh process, in turn, on one GPU:
``--base DIR`` holds the base's ``prefixserve/`` (e.g. ``git archive REV prefixserve | tar -x -C DIR``);
the steps come from ``benchmarks.dense.engine_decode`` of this checkout for both, so only the engine
differs (``--shared-prefix P``: decode tok/s behind one P-token prefix, sharing on, as
``benchmarks/fp8.py``'s shared points). Each round runs both trees (the order alternating), each for
every batch size.

    PYTHONPATH=. python -m benchmarks.probes.tree_ab --base /tmp/base --model dummy:llama-3.1-8b \\
        --quantization fp8 --kv-cache-dtype fp8 --batches 1 64 --out ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def child(args: argparse.Namespace) -> None:
    """Engines from the tree on ``sys.path``: a JSON line of each batch's step times (or tok/s)."""
    import prefixserve

    if args.shared_prefix:
        steps = {b: shared_point(args, b) for b in args.batches}
    else:
        from benchmarks.dense import engine_decode
        from prefixserve import LLM

        llm = LLM(
            model=args.model, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
            dtype="bfloat16", device="cuda", max_num_seqs=max(args.batches), progress=False,
            max_num_batched_tokens=max(8192, max(args.batches) * args.prompt_len),
        )  # fmt: skip
        steps = {b: engine_decode(llm, b, args.prompt_len, args.gen) for b in args.batches}
    print("STEPS " + json.dumps({"engine": str(Path(prefixserve.__file__).parents[1]), **steps}), flush=True)


def shared_point(args: argparse.Namespace, batch: int) -> dict[str, float]:
    """Decode tok/s of ``batch`` requests behind one ``--shared-prefix``-token prefix, sharing on, as
    ``benchmarks/fp8.py``'s shared points (its ``SHARED_OWN`` own tokens each; a fresh engine)."""
    from benchmarks.decode_run import measure, shared_prompts
    from benchmarks.fp8 import SHARED_OWN

    prompts = tuple(shared_prompts(batch, args.shared_prefix, SHARED_OWN, seed=s) for s in (0, 1))
    engine = {"quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype}
    got = measure(args.model, "cuda", "auto", prompts, args.gen, **{k: v for k, v in engine.items() if v})
    return {"tok_s": got["tok_s"], "preemptions": got["preemptions"]}


def run_tree(tree: Path, argv: list[str]) -> dict[str, Any]:
    """``child`` in a fresh process whose ``prefixserve`` is ``tree``'s (the benchmarks are ours)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tree), str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.probes.tree_ab", "--child", *argv],
        env=env, cwd=tree, capture_output=True, text=True, check=False,  # -m puts the cwd first
    )  # fmt: skip
    lines = [x for x in done.stdout.splitlines() if x.startswith("STEPS ")]
    if done.returncode or not lines:
        raise SystemExit(f"the run from {tree} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    steps = json.loads(lines[-1][len("STEPS ") :])
    if Path(steps.pop("engine")) != tree:
        raise SystemExit(f"the run meant for {tree} imported another prefixserve")
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, help="a directory holding the base tree's prefixserve/")
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--shared-prefix", type=int, default=0, help="tok/s behind one prefix this long instead")
    ap.add_argument("--out", default=None, help="the result file (JSON)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    if args.base is None or not (args.base / "prefixserve").is_dir():
        raise SystemExit("--base must be a directory holding the base tree's prefixserve/")
    argv = [
        "--model", args.model, "--kv-cache-dtype", args.kv_cache_dtype,
        "--prompt-len", str(args.prompt_len), "--gen", str(args.gen),
        "--shared-prefix", str(args.shared_prefix), "--batches", *map(str, args.batches),
        *(["--quantization", args.quantization] if args.quantization else []),
    ]  # fmt: skip
    trees = {"base": args.base.resolve(), "head": ROOT}
    rows = []
    for r in range(args.rounds):
        for name in ("base", "head") if r % 2 == 0 else ("head", "base"):
            for b, got in run_tree(trees[name], argv).items():
                rows.append({"round": r, "tree": name, "B": int(b), **got})
                print(rows[-1], flush=True)
    key = "tok_s" if args.shared_prefix else "gpu_ms"  # higher / lower is better
    pick = max if args.shared_prefix else min
    summary = []
    for b in args.batches:
        best = {n: pick(x[key] for x in rows if x["tree"] == n and x["B"] == b) for n in trees}
        ratio = best["head"] / best["base"] if args.shared_prefix else best["base"] / best["head"]
        summary.append({"B": b, f"base_{key}": best["base"], f"head_{key}": best["head"], "speedup": ratio})
    print(f"{'B':>5} {'base ' + key:>14} {'head ' + key:>14} {'speed-up':>9}")
    for s in summary:
        print(f"{s['B']:5d} {s['base_' + key]:14.3f} {s['head_' + key]:14.3f} {s['speedup']:8.3f}x")
    if args.out:
        from benchmarks.harness.info import run_info

        options = {
            k: getattr(args, k) for k in ("model", "quantization", "kv_cache_dtype", "prompt_len", "gen")
        }
        payload = {**run_info(), **options, "base": str(args.base), "rows": rows, "summary": summary}
        Path(args.out).write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
