"""Decode tokens/s of one shared-prefix batch under each way of launching its attention.

Modes: the rules (``auto``), the mixed kernel forced on or off (PREFIXSERVE_MIXED, read per call by
``prefixserve/config.py``), the mixed kernel with its own tiles forced to 64 or 128 rows
(``mixed_rule.own_rows_for`` replaced in this process; the shared tiles still follow
``shared_tokens_for``, so since 5f46836 ``mixed64`` takes 128-token ones in shared-heavy steps),
the rules with every linear layer on cuBLAS (``cublas_dense``: ``fused.skinny_matmuls(False)``),
and the rules with the mixed kernel's shared tiles forced to 64 or 128 tokens (``shared64``,
``shared128``: ``mixed_rule.shared_tokens_for`` replaced in this process). Every measurement builds
a fresh engine (``benchmarks.throughput.measure``: a warm-up run of the same shape, then the timed
run), so each mode captures its own graphs. Prints a table; ``--json`` keeps it.

PYTHONPATH=. python -m benchmarks.probes.step_modes --points 64x16384 256x16384 --modes auto two_kernels
"""

from __future__ import annotations

import argparse
import json
import os
import time

from benchmarks.decode_run import measure, shared_prompts
from prefixserve.attention.planning import mixed_rule
from prefixserve.model import fused

OWN_ROWS_FOR = mixed_rule.own_rows_for

MODES = {  # environment switches (prefixserve/config.py) and in-process overrides
    "auto": {},
    "mixed": {"PREFIXSERVE_MIXED": "1"},
    "two_kernels": {"PREFIXSERVE_MIXED": "0"},
    "mixed64": {"PREFIXSERVE_MIXED": "1", "own_m": 64},
    "mixed128": {"PREFIXSERVE_MIXED": "1", "own_m": 128},
    "cublas_dense": {"skinny": False},  # the rules, every linear layer on cuBLAS
    # the rules, the mixed kernel's shared tiles forced to 64 or 128 tokens (128: beside 64-row own tiles)
    "shared64": {"shared_n": 64},
    "shared128": {"shared_n": 128},
}
SHARED_TOKENS_FOR = mixed_rule.shared_tokens_for


def set_mode(mode: str) -> None:
    """Environment and own tile height for ``mode``; the next engine built runs with them."""
    for k in {k for m in MODES.values() for k in m if k.startswith("PREFIXSERVE_")}:
        os.environ.pop(k, None)
    os.environ.update({k: v for k, v in MODES[mode].items() if k.startswith("PREFIXSERVE_")})
    own_m = MODES[mode].get("own_m")
    mixed_rule.own_rows_for = (lambda *a: own_m) if own_m else OWN_ROWS_FOR
    shared_n = MODES[mode].get("shared_n")
    # 128-token shared tiles only beside 64-row own tiles (``ring_stages``: no room beside 128-row ones)
    forced = lambda own_m, *a: shared_n if own_m == mixed_rule.OWN_M else mixed_rule.SHARED_N  # noqa: E731
    mixed_rule.shared_tokens_for = forced if shared_n else SHARED_TOKENS_FOR


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", nargs="+", default=["64x4096", "64x16384", "256x4096", "256x16384"])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--own", type=int, default=64)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for point in args.points:
        b, p = (int(x) for x in point.split("x"))
        prompts = (shared_prompts(b, p, args.own, seed=0), shared_prompts(b, p, args.own, seed=1))
        for mode in args.modes:
            set_mode(mode)
            t0 = time.perf_counter()
            with fused.skinny_matmuls(MODES[mode].get("skinny", True)):
                r = measure(args.model, "cuda", "auto", prompts, args.gen)
            row = {
                "B": b,
                "P": p,
                "mode": mode,
                "tok_s": r["tok_s"],
                "step_ms": 1e3 * b / r["tok_s"],
                "graphs_mixed": r["graphs_mixed"],
                "graphs_shared": r["graphs_shared"],
                "wall_s": time.perf_counter() - t0,
            }
            rows.append(row)
            print(
                f"B={b} P={p} {mode:>16}: {row['tok_s']:9.0f} tok/s  "
                f"{row['step_ms']:.3f} ms/step "
                f"(mixed {row['graphs_mixed']}/{row['graphs_shared']}, {row['wall_s']:.0f} s)",
                flush=True,
            )
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=1)
    print("| B | P | " + " | ".join(args.modes) + " |")
    for point in args.points:
        b, p = (int(x) for x in point.split("x"))
        cells = [
            next((f"{r['tok_s']:.0f}" for r in rows if (r["B"], r["P"], r["mode"]) == (b, p, m)), "-")
            for m in args.modes
        ]
        print(f"| {b} | {p} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
