"""Probe: where one MoE layer's time goes, per kernel (router matmul, routing, grouping, the two
expert GEMMs, the combine), from the CUDA profiler over eager calls, at one model's shape per B.

    PYTHONPATH=. python -m benchmarks.probes.moe_parts [--model qwen3-30b-a3b] [--batches 1 16 64 256 1024]

``--eager N`` only runs each layer N times, no profiler (CUPTI is Nsight Compute's then):

    ncu --clock-control none -k regex:expert --launch-skip 4 --launch-count 2 \
        python -m benchmarks.probes.moe_parts --batches 1024 --eager 6
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from prefixserve.model.config import ModelConfig
from prefixserve.model.kernels import fused_moe
from prefixserve.model.loader import resolve_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256, 1024])
    ap.add_argument("--json")
    ap.add_argument("--eager", type=int, default=0, help="run each layer N times, unprofiled (ncu)")
    args = ap.parse_args()
    cfg = ModelConfig.from_json(resolve_model(f"dummy:{args.model}").path)
    e, hidden, inter, k = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    dev, dtype = torch.device("cuda"), torch.bfloat16
    w_up = torch.randn(e * 2 * inter, hidden, device=dev, dtype=dtype) * hidden**-0.5
    w_down = torch.randn(e * hidden, inter, device=dev, dtype=dtype) * inter**-0.5
    router = torch.randn(e, hidden, device=dev, dtype=dtype) * hidden**-0.5
    out = []
    for b in args.batches:
        x = torch.randn(b, hidden, device=dev, dtype=dtype)

        def layer() -> torch.Tensor:
            weights, ids = fused_moe.route(x @ router.T, k, cfg.router_rule, cfg.norm_topk_prob)  # noqa: B023
            return fused_moe.experts_forward(x, w_up, w_down, weights, ids)  # noqa: B023

        for _ in range(args.eager or 3):
            layer()
        torch.cuda.synchronize()
        if args.eager:
            continue
        reps = 20
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                layer()
            torch.cuda.synchronize()
        per = defaultdict(float)
        for ev in prof.events():
            if ev.device_type.name == "CUDA":
                per[ev.name[:40]] += ev.device_time / reps
        total = sum(per.values())
        print(f"B={b}: kernels {total:.1f} us per layer")
        for name, us in sorted(per.items(), key=lambda kv: -kv[1]):
            print(f"   {us:8.1f} us  {name}")
        out.append({"B": b, "kernel_us": dict(per), "total_us": total})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
