"""Probe: our paged decode at B=1 over a long context (where FlashInfer's batch decode led, 4K and 16K)
across KV split counts, tile widths, warps and pipeline stages, under CUDA graphs with L2 flushed
(the split kernel and its merge, as ``paged_attention`` runs them); the default choice beside.

    PYTHONPATH=. python -m benchmarks.probes.b1_splits [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from benchmarks.harness.timing import bench_ms, graphed
from benchmarks.peers_gpu_batch import build
from prefixserve.attention.kernels.merge import merge_partials
from prefixserve.attention.kernels.paged_attention import launch_paged, paged_attention

GRID = [
    (splits, bn, warps, stages)
    for splits in (16, 32, 48)
    for bn in (64, 128)
    for warps in (4, 8)
    for stages in (2, 3, 4)
]


def split_call(args: tuple, ctx: int, splits: int, bn: int, warps: int, stages: int) -> object:
    """The split kernel with these launch settings, then the merge: ``paged_attention``'s two launches."""
    q = args[0]
    size = math.ceil(math.ceil(ctx / splits) / bn) * bn
    splits = math.ceil(ctx / size)
    o_part = torch.empty(splits, *q.shape, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(splits, *q.shape[:2], dtype=torch.float32, device=q.device)
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    step_o, step_lse = o_part[0].numel(), lse_part[0].numel()

    def run() -> torch.Tensor:
        launch_paged(
            *args,
            splits,
            size,
            o_part[0],
            lse_part[0],
            step_o,
            step_lse,
            bn,
            num_warps=warps,
            num_stages=stages,
        )
        tokens = q.shape[0]
        merge_partials(
            o_part.view(-1, *q.shape[1:]), lse_part.view(-1, q.shape[1]), tokens,
            num_parts=splits, part_stride=tokens, out=out, out_lse=lse,
        )  # fmt: skip
        return out

    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/b1_splits")
    args = ap.parse_args()
    rows = []
    for ctx in (4096, 16384):
        batch = build("plain", [1], [ctx], (32, 8, 128), "cuda")
        m = batch.meta
        call = (
            batch.q,
            batch.k_cache,
            batch.v_cache,
            m.block_tables,
            m.seq_lens,
            m.query_start_loc,
            batch.scale,
            1,
        )
        ref, _ = paged_attention(*call, max_seq_len=ctx)
        default_ms = bench_ms(graphed(lambda c=call, n=ctx: paged_attention(*c, max_seq_len=n)))
        rows.append({"ctx": ctx, "default": True, "ms": default_ms})
        print(f"ctx {ctx} default: {default_ms * 1000:.1f} us", flush=True)
        for splits, bn, warps, stages in GRID:
            row = {"ctx": ctx, "splits": splits, "block_n": bn, "warps": warps, "stages": stages}
            try:
                fn = split_call(call, ctx, splits, bn, warps, stages)
                row["max_err"] = float((fn().float() - ref.float()).abs().max())
                row["ms"] = bench_ms(graphed(fn))
            except Exception as exc:
                row["error"] = repr(exc)[:200]
            rows.append(row)
        best = sorted(
            (r for r in rows if r["ctx"] == ctx and "ms" in r and not r.get("default")), key=lambda r: r["ms"]
        )
        for r in best[:6]:
            print(f"  {r['ms'] * 1000:.1f} us: {r}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "b1_splits.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
