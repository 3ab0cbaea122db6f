"""Probe: the paged decode's in-kernel merge at B=1 and 16 (``merge.merge_last``) by turn width
(``MERGE_UNROLL``: splits whose partials a turn loads together) and by the split choice's waves of
programs (``choose_split`` aims at 2), beside FlashInfer's batch decode. Each variant runs
``benchmarks/peers_gpu.py run --kinds plain`` in a process of its own, in the order given (interleave
repeats: runs of one build move by about 1 us at 16K), and the table lists our microseconds (ours /
FlashInfer's best) per point.

    PYTHONPATH=. python -m benchmarks.probes.merge_turns --variants u8 u16 u8 u16 w3 [--baseline DIR]

A variant is ``uN`` (N splits a turn) or ``wN`` (splits for N waves), or both (``u8w3``);
``--baseline DIR`` runs a checkout's ``prefixserve`` (e.g. an older commit's, ``git archive``) first
and last, as ``base``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

BOOT = """
import os, runpy, sys
import prefixserve.attention.kernels.paged_attention as p
if os.environ.get("PROBE_UNROLL"):
    p.MERGE_UNROLL = int(os.environ["PROBE_UNROLL"])
if os.environ.get("PROBE_WAVES"):
    sms, waves = p.num_sms, float(os.environ["PROBE_WAVES"])
    p.num_sms = lambda device: max(1, round(sms(device) * waves / 2))
sys.argv = ["peers_gpu", *sys.argv[1:]]
runpy.run_module("benchmarks.peers_gpu", run_name="__main__")
"""


def variant_env(name: str) -> dict[str, str]:
    """PROBE_UNROLL / PROBE_WAVES for a variant name (``u8``, ``w3``, ``u8w3``, ``base``)."""
    env = {}
    for key, value in re.findall(r"([uw])(\d+(?:\.\d+)?)", name):
        env["PROBE_UNROLL" if key == "u" else "PROBE_WAVES"] = value
    return env


def table(runs: dict[str, Path]) -> list[str]:
    """Markdown rows: our us (ours / theirs) per point and variant, FlashInfer's best of the first run."""
    rows = {}
    for label, path in runs.items():
        if path.exists():
            rows[label] = {
                (r["layout"], r["B"], r["lengths"][0]): r for r in json.loads(path.read_text())["rows"]
            }
    points = sorted({k for by in rows.values() for k in by}, key=lambda k: (k[0], k[1], int(k[2])))
    lines = ["| point | " + " | ".join(rows) + " | FlashInfer us |", "| --- |" + " ---: |" * (len(rows) + 1)]
    for k in points:
        cells, theirs = [], None
        for by in rows.values():
            r = by.get(k, {})
            ms, ratio = r.get("ours_paged_ms"), r.get("ours_over_theirs")
            cells.append(f"{ms * 1e3:.1f} ({ratio:.3f})" if ms and ratio else "-")
            theirs = theirs or r.get("fi_decode_best_ms")
        lines.append(
            f"| {k[0]} B={k[1]} {k[2]} | " + " | ".join(cells) + f" | {theirs * 1e3 if theirs else 0:.1f} |"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=["u8", "u4", "u16", "u8", "u4", "u16"])
    ap.add_argument(
        "--baseline", help="a directory holding another build's prefixserve/ (run first and last)"
    )
    ap.add_argument("--batches", nargs="+", default=["1", "16"])
    ap.add_argument("--fi-dir", default=".fi")
    ap.add_argument("--out", default="/tmp/merge_turns")
    args = ap.parse_args()
    order = (["base"] if args.baseline else []) + args.variants + (["base"] if args.baseline else [])
    out, here = Path(args.out), Path.cwd()
    runs: dict[str, Path] = {}
    for i, name in enumerate(order):
        label = f"{i + 1}-{name}"
        tree = args.baseline if name == "base" else str(here)
        env = {**os.environ, **variant_env(name), "PYTHONPATH": os.pathsep.join([tree, str(here)])}
        cmd = [sys.executable, "-c", BOOT, "run", "--kinds", "plain", "--batches", *args.batches]
        cmd += ["--fi-dir", args.fi_dir, "--out", str(out / label)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        if done.returncode:
            print(f"{label} failed: {done.stderr[-400:]}", flush=True)
        runs[label] = out / label / "peers_gpu.json"
    print("\n".join(table(runs)))


if __name__ == "__main__":
    main()
