"""Do the per-step integer arguments the kernels no longer specialise on cost speed?

Triton compiles a kernel again for an int argument equal to 1 or divisible by 16; the kernels mark
their per-step counts ``do_not_specialize`` (``triton_support/compile_watch.py`` says why). This
times each such kernel both ways in one run, on the shapes decode steps meet: the skinny matmul at
Llama-3.1-8B's o / qkv / gate-up / down shapes (rows 1, 16, 64, a CUDA graph over weight copies), and
the paged decode kernel (B = 16 / 64 / 256 sequences of 1K / 4K KV, launched as an eager step and as
a decode graph launches it), the paged kernel also with each per-step int alone unspecialised. The
table gives times in us and ratios to Triton's default specialisation (> 1: slower). Writes
``specialize_ab.json`` under ``--out``.

PYTHONPATH=. python -m benchmarks.probes.specialize_ab --out /tmp
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from benchmarks.harness.timing import bench_ms, graph_ms
from prefixserve.attention.kernels import paged_attention
from prefixserve.model.kernels import skinny_matmul
from prefixserve.triton_support import require_triton
from prefixserve.triton_support.bound import BoundKernel

triton, _ = require_triton()

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def specialised(kernel):
    """The same kernel source compiled with Triton's default specialisation (every int argument)."""
    return triton.jit(kernel.fn)


def time_skinny(rows: int, n: int, k: int) -> float:
    copies = max(2, math.ceil(200e6 / (n * k * 2)))  # > L2: each call reads its own weight
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
    config = skinny_matmul.skinny_config(rows, n) or (32, 6)
    return graph_ms(lambda i: skinny_matmul.skinny_linear(x, weights[i], config=config, out=out), copies)


def time_paged(batch: int, kv: int, graph_form: bool = False) -> float:
    """The paged decode kernel over ``batch`` sequences of ``kv`` tokens: as an eager step launches it
    (``choose_split``'s split size), or as a decode graph does (``graph_form``: split size 0, each
    sequence's KV cut into the splits on the device)."""
    block, heads, kv_heads, dim = 16, 32, 8, 128
    blocks = batch * kv // block
    k_cache = torch.randn(blocks, block, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(blocks, device="cuda", dtype=torch.int32).view(batch, kv // block)
    seq_lens = torch.full((batch,), kv, device="cuda", dtype=torch.int32)
    qsl = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
    splits, split_size = paged_attention.choose_split(kv, batch * kv_heads, q.device, 64)
    if graph_form:
        split_size = 0
    o = torch.empty(splits, batch, heads, dim, device="cuda", dtype=torch.float32)
    lse = torch.empty(splits, batch, heads, device="cuda", dtype=torch.float32)
    args = (q, k_cache, v_cache, tables, seq_lens, qsl, dim**-0.5, 1, splits, split_size, o[0], lse[0])
    strides = (batch * heads * dim, batch * heads)
    return bench_ms(lambda: paged_attention.launch_paged(*args, *strides))


PAGED_ARGS = ("q_tiles", "split_size", "stride_bt")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args()
    plain_skinny, plain_paged = skinny_matmul._skinny, paged_attention._paged_kernel
    fn = paged_attention._paged_kernel.fn
    rows = []
    # the skinny matmul: as shipped (rows unspecialised) against Triton's default
    alt_skinny = BoundKernel(specialised(skinny_matmul._skinny_kernel))
    for name, shape in SHAPES.items():
        for m in (1, 16, 64):
            times = {}
            for label, kernel in (("shipped", plain_skinny), ("specialised", alt_skinny)):
                skinny_matmul._skinny = kernel
                times[label] = time_skinny(m, *shape)
            skinny_matmul._skinny = plain_skinny
            rows.append({"kernel": "skinny", "case": name, "rows": m, "unspecialised": "M", **times})
    # the paged kernel: as shipped, Triton's default, and each per-step int alone unspecialised
    variants = {"shipped": plain_paged, "specialised": specialised(plain_paged)}
    variants |= {f"only {a}": triton.jit(fn, do_not_specialize=[a]) for a in PAGED_ARGS}
    for graph_form in (False, True):
        for b in (16, 64, 256):
            for kv in (1024, 4096):
                times = {}
                for label, kernel in variants.items():
                    paged_attention._paged_kernel = kernel
                    times[label] = time_paged(b, kv, graph_form)
                paged_attention._paged_kernel = plain_paged
                form = "graph" if graph_form else "eager"
                rows.append({"kernel": f"paged {form}", "case": f"B={b} KV={kv}", "rows": b, **times})
    for row in rows:
        row["ratio"] = row["shipped"] / row["specialised"]  # > 1: shipped slower
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "shipped_paged_unspecialised": list(getattr(plain_paged,
              "do_not_specialize", [])), "rows": rows}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "specialize_ab.json").write_text(json.dumps(result, indent=1))
    extra = [f"only {a}" for a in PAGED_ARGS]
    print(
        f"{'kernel':12} {'case':14} {'shipped':>8} {'spec':>8} {'ratio':>6} "
        + " ".join(f"{e:>16}" for e in extra)
    )
    for r in rows:
        cells = " ".join(f"{r[e] / r['specialised']:16.3f}" if e in r else f"{'':>16}" for e in extra)
        print(f"{r['kernel']:12} {r['case']:14} {r['shipped'] * 1e3:8.1f} {r['specialised'] * 1e3:8.1f} "
              f"{r['ratio']:6.3f} {cells}")  # fmt: skip


if __name__ == "__main__":
    main()
