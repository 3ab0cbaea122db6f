"""Does a sliding layer's decode step gain from reading the shared segments inside its windows once?

Backs ``attention/planning/window_plan.py`` (segments cut to the blocks inside every holder's window,
read once by the shared kernel, the rest walked per row). Runs the same shared-prefix decode twice in one
process: as shipped, and with the window plans switched off (every row walks its whole window), and
prints decode tok/s, the steps whose sliding layers had a window plan, and the plans' KV rows read
against every row's window.

    PYTHONPATH=. python -m benchmarks.probes.window_sharing [--model dummy:gemma-3-12b] [--batch 256]
        [--prefix 16384] [--own 64] [--gen 32]
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dummy:gemma-3-12b")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prefix", type=int, default=16384)
    ap.add_argument("--own", type=int, default=64)
    ap.add_argument("--gen", type=int, default=32)
    args = ap.parse_args()
    from benchmarks.decode_run import measure, shared_prompts
    from prefixserve.attention import window, window_graph
    from prefixserve.attention.planning import window_plan

    made = window_plan.make_window_plan
    counts: Counter[str] = Counter()

    def counted(meta, plan, blocks, size):
        out = made(meta, plan, blocks, size)
        counts["plans" if out is not None else "no plan"] += 1
        if out is not None:
            counts["plan_kv_rows"] += out.kv_tokens_read
            counts["window_kv_rows"] += int(sum(min(size, n) for n in meta.seq_lens_host))
        return out

    window_plan.make_window_plan = window_graph.make_window_plan = counted  # eager steps and graphs
    prompts = (
        shared_prompts(args.batch, args.prefix, args.own, seed=0),
        shared_prompts(args.batch, args.prefix, args.own, seed=1),
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for mode in ("shipped", "no window plans"):
        counts.clear()
        if mode != "shipped":
            window.window_plan = lambda meta, size: None
            window_graph.make_window_plan = lambda meta, plan, blocks, size: None
        got = measure(args.model, device, "auto", prompts, args.gen)
        rows.append((mode, got["tok_s"], got["host_overhead_frac"], dict(counts)))
    for mode, tok_s, host, seen in rows:
        print(f"{mode:16s} {tok_s:10,.0f} tok/s  host overhead {host:.3f}  {seen}")
    print(f"shipped / no plans: {rows[0][1] / rows[1][1]:.2f}x")


if __name__ == "__main__":
    main()
