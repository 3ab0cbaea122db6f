"""Probe: our paged decode at B=1 over a long context (where FlashInfer's batch decode led, 4K and 16K)
across KV split counts and tile widths, under CUDA graphs with L2 flushed; the default choice beside.

    PYTHONPATH=. python -m benchmarks.probes.b1_splits [--out DIR]
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

from benchmarks.harness.timing import bench_ms, graphed
from benchmarks.peers_gpu_batch import build
from prefixserve.attention.kernels.paged_attention import paged_attention


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/b1_splits")
    args = ap.parse_args()
    rows = []
    for ctx in (4096, 16384):
        batch = build("plain", [1], [ctx], (32, 8, 128), "cuda")
        m = batch.meta
        call_args = (batch.q, batch.k_cache, batch.v_cache, m.block_tables, m.seq_lens, m.query_start_loc)
        ref, _ = paged_attention(*call_args, batch.scale, 1, max_seq_len=ctx)
        for splits in (None, 8, 16, 32, 48, 64, 96, 128):
            for block_n in (32, 64, 128):
                opts = {"num_splits": splits, "block_n": block_n, "max_seq_len": ctx}
                fn = partial(paged_attention, *call_args, batch.scale, 1, **opts)

                try:
                    err = float((fn()[0].float() - ref.float()).abs().max())
                    ms = bench_ms(graphed(fn))
                except Exception as exc:
                    rows.append({"ctx": ctx, "splits": splits, "block_n": block_n, "error": repr(exc)[:200]})
                    continue
                rows.append({"ctx": ctx, "splits": splits, "block_n": block_n, "ms": ms, "max_err": err})
                print(f"ctx {ctx} splits {splits} block_n {block_n}: {ms * 1000:.1f} us (err {err:.1e})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "b1_splits.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
