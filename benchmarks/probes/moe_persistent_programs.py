"""Probe: the persistent 64-row expert tile's programs an SM (``fused_moe.Tile.per_sm``) by
pipeline stages and warps, one Qwen3-30B-A3B MoE layer at B = 1,024 and 1,536 (graphed, L2
flushed), each output checked against the shipped launch's; JSON to ``$OUT/per_sm.json``.

    OUT=dir PYTHONPATH=. python benchmarks/probes/moe_persistent_programs.py
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

# (programs an SM, stages, warps); three programs of three stages fill an SM's shared memory
LAUNCHES = ((3, 3, 4), (2, 3, 4), (4, 2, 4), (4, 3, 4), (5, 2, 4), (2, 4, 4), (3, 2, 4), (2, 3, 8), (3, 3, 8))


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    cfg = ModelConfig.from_json(resolve_model("dummy:qwen3-30b-a3b").path)
    gen, w_up, w_down, _ = layer_weights(cfg)
    rows = []
    for b in (1024, 1536):
        x = torch.randn(b, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
        logits = torch.rand(b, cfg.num_experts, device="cuda", generator=gen)
        weights, ids = fused_moe.route(logits, 8, "softmax_topk", True)
        base = fused_moe.TILES[-1][1]  # the 64-row persistent tile
        want = fused_moe.experts_forward(x, w_up, w_down, weights, ids, tile=base)
        for per_sm, stages, warps in LAUNCHES:
            tile = base._replace(stages=stages, warps=warps, per_sm=per_sm)

            def run(tile: fused_moe.Tile = tile) -> torch.Tensor:
                return fused_moe.experts_forward(x, w_up, w_down, weights, ids, tile=tile)  # noqa: B023

            got = run()
            us = 1e3 * bench_ms(graphed(run), 150)
            rows.append({"B": b, "per_sm": per_sm, "stages": stages, "warps": warps, "us": us,
                         "equal": bool(torch.equal(got, want))})  # fmt: skip
            print(rows[-1], flush=True)
    commit = os.environ.get("PREFIXSERVE_COMMIT")
    payload = {"device": torch.cuda.get_device_name(), "commit": commit, "rows": rows}
    with open(os.path.join(os.environ["OUT"], "per_sm.json"), "w") as f:
        json.dump(payload, f, indent=1)


if __name__ == "__main__":
    main()
