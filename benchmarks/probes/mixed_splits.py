"""One decode attention call under each rule for splitting a mixed step's shared segment (the KV splits).

Rules (``PREFIXSERVE_MIXED_SPLITS``, read at planning by ``prefixserve/config.py``): ``waves`` splits
each tall M-tile until the shared tickets alone fill the SMs' waves (``shared_plan.wave_splits``);
``hide`` splits no further than the own part outlasts the shared tickets
(``shared_plan.hidden_splits``). Each point's call runs as the engine would launch it (the mixed rule
on ``auto``), graphed, timed with L2 flushed (``benchmarks.harness.timing.bench_ms``); the table gives
each rule's KV splits, the launch (mixed or two kernels) and microseconds. ``--heads`` sets query /
KV heads: 32/8 is the 8B, 16/4 its TP=2 shard, 32/4 the 70B's TP=2 shard. Points are BxPxS
(sequences, shared prefix tokens, own tokens each).

PYTHONPATH=. python -m benchmarks.probes.mixed_splits --heads 32/8 16/4 --points 256x1024x64 256x1024x128
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import torch

from benchmarks.attention import Case
from benchmarks.harness.info import run_info
from benchmarks.harness.timing import bench_ms, graphed
from prefixserve.attention.kernels.triton_backend import TritonBackend

RULES = ("waves", "hide")


def call(case: Case, rule: str) -> tuple[float, dict, torch.Tensor]:
    """Microseconds of ``case``'s graphed call under ``rule``, its splits and launch, and its output."""
    os.environ["PREFIXSERVE_MIXED_SPLITS"] = rule
    be = TritonBackend()
    be.overlap_min_rows = 0  # the shared kernel on a side stream where two kernels run, as in decode graphs
    meta = dataclasses.replace(case.meta, plan=None, stats={})
    be.prepare(meta)
    out = be.forward(case.q, case.k_cache, case.v_cache, meta, case.scale)
    lay = next(iter(meta.plan.layouts.values()))
    fn = graphed(lambda: be.forward(case.q, case.k_cache, case.v_cache, meta, case.scale))
    us = 1e3 * bench_ms(fn)
    info = {"splits": max(lay.work.splits, default=1), "mixed": bool(getattr(lay, "mixed", None))}
    return us, info, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", nargs="+", default=["256x1024x64", "256x1024x128", "256x1024x192"])
    ap.add_argument("--heads", nargs="+", default=["32/8", "16/4"], help="query / KV heads, e.g. 16/4")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for heads_arg in args.heads:
        heads = tuple(int(x) for x in heads_arg.split("/"))
        for point in args.points:
            b, p, s = (int(x) for x in point.split("x"))
            case = Case(b, p, s, dev, heads=heads)
            row: dict = {"heads": heads_arg, "B": b, "P": p, "S": s}
            ref = None
            for rule in RULES:
                us, info, out = call(case, rule)
                if ref is None:
                    ref = out.float()
                row[rule] = us
                row[f"{rule}_splits"], row[f"{rule}_mixed"] = info["splits"], info["mixed"]
                row[f"{rule}_err"] = float((out.float() - ref).abs().max() / ref.abs().max())
            rows.append(row)
            print(
                json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}),
                flush=True,
            )
            del case
    os.environ.pop("PREFIXSERVE_MIXED_SPLITS", None)
    print("| heads | B | P | S | splits waves / hide | launch | waves us | hide us | waves / hide |")
    print("| --- | ---: | ---: | ---: | --- | --- | ---: | ---: | ---: |")
    for r in rows:
        launch = "mixed" if r["hide_mixed"] else "two kernels"
        print(
            f"| {r['heads']} | {r['B']} | {r['P']} | {r['S']} | {r['waves_splits']} / {r['hide_splits']} | "
            f"{launch} | {r['waves']:.1f} | {r['hide']:.1f} | {r['waves'] / r['hide']:.3f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(run_info() | {"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
