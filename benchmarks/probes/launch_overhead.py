"""Host microseconds per attention call (one layer), eager, for the Triton backends: where launches go.

Times ``backend.forward`` back to back on one step's metadata (no events, no syncs inside the loop),
next to a plain torch op for scale, then prints cProfile's top entries for the shared path.

    PYTHONPATH=. python -m benchmarks.probes.launch_overhead
"""

from __future__ import annotations

import cProfile
import pstats
import time

import torch

from prefixserve.attention.backend import make_backend
from prefixserve.attention.metadata import build_metadata


def main(batch: int = 64, prefix: int = 4096, own: int = 80) -> None:
    bs, hkv, hq, d = 16, 8, 32, 128
    pre = list(range(prefix // bs))
    nxt = len(pre)
    tables = []
    for _ in range(batch):
        n = -(-own // bs)
        tables.append(pre + list(range(nxt, nxt + n)))
        nxt += n
    k = torch.randn(nxt, bs, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
    meta_args = (bs, [1] * batch, [prefix + own] * batch, tables, "cuda")
    rows = []
    for name in ("triton_paged", "triton", "auto"):
        be = make_backend(name)
        meta = build_metadata(*meta_args)
        t0 = time.perf_counter()
        be.prepare(meta)
        prep = time.perf_counter() - t0
        for _ in range(3):
            be.forward(q, k, v, meta, 0.1)
        torch.cuda.synchronize()
        n = 200
        t0 = time.perf_counter()
        for _ in range(n):
            be.forward(q, k, v, meta, 0.1)
        host = (time.perf_counter() - t0) / n
        torch.cuda.synchronize()
        gpu = (time.perf_counter() - t0) / n
        rows.append((name, prep * 1e3, host * 1e6, gpu * 1e6, meta.stats.get("cascade", 0)))
        if name == "triton":
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(50):
                be.forward(q, k, v, meta, 0.1)
            prof.disable()
            torch.cuda.synchronize()
            pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    t0 = time.perf_counter()
    for _ in range(200):
        torch.empty_like(q).add_(1.0)
    empty_add = (time.perf_counter() - t0) / 200 * 1e6
    torch.cuda.synchronize()
    print(f"\nB={batch} P={prefix}: host us per forward (one layer); empty_like+add_: {empty_add:.0f} us")
    print("| backend | prepare ms | host us/call | wall us/call (GPU incl.) | cascade |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r[0]} | {r[1]:.2f} | {r[2]:.0f} | {r[3]:.0f} | {r[4]:.0f} |")


if __name__ == "__main__":
    main()
