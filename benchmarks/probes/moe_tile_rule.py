"""Probe: the fused MoE's tile rule (``fused_moe.tiles``, by the mean tokens an expert) across B: at
each B the shipped tile beside the transposed 32-row tile, the persistent 64-row tile (three programs
an SM), the persistent 128-row tile (two) and the widest tile of a program a tile, one Qwen3-30B-A3B
MoE layer (graphed, L2 flushed), each output checked against the shipped tile's bit for bit; JSON to
``$OUT/tile_rule.json``.

    OUT=dir PYTHONPATH=. python benchmarks/probes/moe_tile_rule.py [--batches 256 512 1024 1536 4096]

``--eager N`` runs each tile N times, untimed, for Nsight Compute (docs/kernels.md §9 has the L2
fabric counters that explain the rule).
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from benchmarks.harness.timing import bench_ms, graphed
from benchmarks.moe import layer_weights
from prefixserve.model.config import ModelConfig
from prefixserve.model.kernels import fused_moe
from prefixserve.model.loader import resolve_model

CANDIDATES = {  # the rule's own tiles, and the widest tile before it (a program a tile)
    "rows32_swap": fused_moe.TILES[1][1],
    "rows64_persistent": fused_moe.TILES[2][1],
    "rows128_persistent": fused_moe.WIDEST_TILE,
    "rows128_a_program_a_tile": fused_moe.Tile(128, 128, 128, 64, 8, 3),
}
BATCHES = [256, 384, 512, 768, 1024, 1280, 1536, 2048, 4096, 8192]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=BATCHES)
    ap.add_argument("--eager", type=int, default=0, help="run each tile N times, untimed (for ncu)")
    ap.add_argument("--only", nargs="+", choices=list(CANDIDATES), help="the tiles beside the shipped one")
    args = ap.parse_args()
    cfg = ModelConfig.from_json(resolve_model("dummy:qwen3-30b-a3b").path)
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    gen, w_up, w_down, _ = layer_weights(cfg)
    names = args.only or list(CANDIDATES)
    rows = []
    for b in args.batches:
        x = torch.randn(b, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
        logits = torch.rand(b, e, device="cuda", generator=gen)
        weights, ids = fused_moe.route(logits, k, "softmax_topk", True)
        shipped = fused_moe.tiles(b, k, e)
        want = fused_moe.experts_forward(x, w_up, w_down, weights, ids, tile=shipped)
        for name, tile in [("shipped", shipped)] + [(n, CANDIDATES[n]) for n in names]:

            def run(tile: fused_moe.Tile = tile) -> torch.Tensor:
                return fused_moe.experts_forward(x, w_up, w_down, weights, ids, tile=tile)  # noqa: B023

            if args.eager:
                for _ in range(args.eager):
                    run()
                torch.cuda.synchronize()
                continue
            got = run()
            us = 1e3 * bench_ms(graphed(run), 150)
            rows.append({"B": b, "tokens_an_expert": b * k / e, "name": name, "tile": list(tile), "us": us,
                         "equal": bool(torch.equal(got, want))})  # fmt: skip
            print(rows[-1], flush=True)
    if args.eager:
        return
    print(f"{'B':>6} {'tile':<26} {'us':>8}  equal")
    for r in rows:
        print(f"{r['B']:6d} {r['name']:<26} {r['us']:8.1f}  {r['equal']}")
    commit = os.environ.get("PREFIXSERVE_COMMIT")
    payload = {"device": torch.cuda.get_device_name(), "commit": commit, "rows": rows}
    with open(os.path.join(os.environ.get("OUT", "."), "tile_rule.json"), "w") as f:
        json.dump(payload, f, indent=1)


if __name__ == "__main__":
    main()
