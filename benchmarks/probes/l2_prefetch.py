"""Does a decode product run faster when its weight was prefetched into L2 during the all-reduce before it?

At TP=2 a decode layer's two all-reduces (fused with the next norm, ``kernels/peer_norm.py``) wait
about 10 us each on NVLink while HBM sits idle, and the product after each (qkv after the attention's
sum, gate-up after the MLP's) then reads its weight shard from HBM. This probe times, per product
and row count, graphed over enough weight copies that L2 is cold when a copy comes round again:

- ``cold``: a window kernel (``--window-us`` of spinning in 256 programs of 8 warps, as the fused
  all-reduce's grid at 256 rows), then the product;
- ``pf``: the same window kernel also issuing L2 prefetches of the product's weight (its first
  ``--budget-mb``), then the product;
- ``window`` and ``window+pf`` alone, to see whether the prefetch lengthens the window.

Saved = cold - pf, us a call. Prefetch forms (``--forms``): ``bulk`` (``cp.async.bulk.prefetch.L2``,
4 KB an instruction) and ``line`` (``prefetch.global.L2::evict_last``, one 128 B line).

PYTHONPATH=. python -m benchmarks.probes.l2_prefetch --json out/l2_prefetch.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.harness.info import git_commit
from benchmarks.harness.timing import graph_ms
from benchmarks.probes.lt_candidates import SHAPES, copies_for
from prefixserve.triton_support import require_triton

triton, tl = require_triton()

BULK = 4096  # bytes a bulk prefetch instruction
LINE = 128


@triton.jit
def _window_kernel(out_ptr, wait_ns, pf_ptr, pf_bytes, FORM: tl.constexpr, BLOCK: tl.constexpr):
    """Spin ``wait_ns`` (the all-reduce's stand-in) after issuing prefetches of this program's share
    of ``pf_bytes`` at ``pf_ptr`` (FORM 0: none, 1: bulk 4 KB, 2: 128 B lines)."""
    pid = tl.program_id(0)
    if FORM != 0:
        step: tl.constexpr = 4096 if FORM == 1 else 128
        per_pass = tl.num_programs(0) * BLOCK * step
        offs = tl.arange(0, BLOCK).to(tl.int64) * step
        for base in range(pid * BLOCK * step, pf_bytes, per_pass):
            at = base + offs
            addrs = pf_ptr + tl.where(at < pf_bytes, at, 0)
            if FORM == 1:
                tl.inline_asm_elementwise(
                    "cp.async.bulk.prefetch.L2.global [$1], 4096;\n\tmov.u32 $0, 0;",
                    "=r,l",
                    [addrs],
                    dtype=tl.int32,
                    is_pure=False,
                    pack=1,
                )
            else:
                tl.inline_asm_elementwise(
                    "prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;",
                    "=r,l",
                    [addrs],
                    dtype=tl.int32,
                    is_pure=False,
                    pack=1,
                )
    start = tl.extra.cuda.globaltimer()
    while tl.extra.cuda.globaltimer() - start < wait_ns:
        pass
    tl.store(out_ptr + pid, pid)


def window(out: torch.Tensor, wait_us: float, weight: torch.Tensor, nbytes: int, form: int) -> None:
    programs = out.numel()
    _window_kernel[(programs,)](out, int(wait_us * 1000), weight, nbytes, FORM=form, BLOCK=256, num_warps=8)


def measure(rows: int, n: int, k: int, wait_us: float, budget: int, forms: list[str]) -> dict:
    device = torch.device("cuda")
    copies = copies_for(n, k)
    weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    out = torch.empty(rows, n, device=device, dtype=torch.bfloat16)
    scratch = torch.empty(256, dtype=torch.int32, device=device)
    wbytes = n * k * 2
    nbytes = min(wbytes, budget)
    as_bytes = [w.view(torch.int8).view(-1) for w in weights]

    def timed(form: int, gemm: bool) -> float:
        def call(i: int) -> None:
            window(scratch, wait_us, as_bytes[i], nbytes, form)
            if gemm:
                torch.mm(x, weights[i].t(), out=out)

        return graph_ms(call, copies) * 1e3

    r = {"copies": copies, "weight_mb": wbytes / 2**20, "prefetch_mb": nbytes / 2**20}
    r["window_us"] = timed(0, False)
    r["cold_us"] = timed(0, True) - r["window_us"]
    for name in forms:
        form = {"bulk": 1, "line": 2}[name]
        r[f"window_{name}_us"] = timed(form, False)
        r[f"{name}_us"] = timed(form, True) - r["window_us"]
    return r


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--models", nargs="+", default=["8b_tp2", "8b_tp1"])
    ap.add_argument("--window-us", type=float, nargs="+", default=[10.0])
    ap.add_argument("--budget-mb", type=float, nargs="+", default=[24.0, 40.0])
    ap.add_argument("--forms", nargs="+", default=["bulk", "line"])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    results, lines = [], []
    for model in args.models:
        for layer, (n, k) in SHAPES[model].items():
            for rows in args.rows:
                for wait in args.window_us:
                    for mb in args.budget_mb:
                        r = {
                            "model": model,
                            "layer": layer,
                            "rows": rows,
                            "N": n,
                            "K": k,
                            "window_set_us": wait,
                        }
                        r.update(measure(rows, n, k, wait, int(mb * 2**20), args.forms))
                        results.append(r)
                        line = (
                            f"{model:7s} {layer:8s} {rows:4d} win {wait:4.1f} pf {r['prefetch_mb']:5.1f}/"
                            f"{r['weight_mb']:5.1f} MB: window {r['window_us']:5.1f} cold {r['cold_us']:6.1f}"
                        )
                        for name in args.forms:
                            saved = r["cold_us"] - r[f"{name}_us"]
                            line += (
                                f" | {name} {r[f'{name}_us']:6.1f} (saved {saved:5.1f},"
                                f" window {r[f'window_{name}_us']:5.1f})"
                            )
                        print(line, flush=True)
                        lines.append(line)
    if args.json:
        info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": git_commit()}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**info, "results": results}, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
