"""Probe: a decode layer's FP8 products one after another against one stream over the same weights.

A persistent layer kernel (``docs/kernels.md`` §10) would stream a layer's weights without each
product's ramp and drain. Short of the data dependences between the products, its ceiling is one
W8A8 product over the layer's K = 4,096 weights stacked (qkv, o and gate-up as one [N, 4,096]
weight) beside the down product. Llama-3.1-8B shape, M in {1, 64}, each form a CUDA graph replayed
with L2 flushed (``bench_ms``), us:

  * ``chain``: the engine's four products in one graph (qkv; o and, at one row, down in two K
    slices; the fused gate-up), launched as dependents as in a decode step;
  * ``stacked``: one product over the stacked weight, then down as the chain runs it;
  * ``bytes``: the layer's FP8 weight bytes over the copy rate measured in the run.

``--layouts``: how fast a program-a-tile kernel can only read such a weight (159 MB of e4m3, its
tiles summed so the loads stay), in the row-major layout the products read (a [32, 256] tile a
step: 32 segments of 256 bytes, a row apart) against the same bytes laid out tile by tile (each
step's 8 KB contiguous), and torch's sum over 2 GiB (a read-only stream), TB/s. ``--sizes``: the
bare read over 16 MB to 2 GiB and a line through its times (a launch's fixed cost, the rate it
tends to).

    PYTHONPATH=. python -m benchmarks.probes.fp8_layer_stream [--rows 1 64] [--layouts] [--sizes] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch

from benchmarks.harness.info import run_info
from benchmarks.harness.timing import bench_clean_us, bench_ms, graphed, measure_ceilings
from prefixserve.model import fp8
from prefixserve.model.kernels.fp8_matmul import fp8_gated, fp8_linear, fp8_partials, quantize_rows
from prefixserve.triton_support import require_triton

triton, tl = require_triton()

HIDDEN, QKV, INTER = 4096, 6144, 14336


def _weights(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return fp8.quantize_rows(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5)


def point(m: int, copy_tbps: float) -> dict:
    """The three forms at ``m`` rows."""
    qkv, o, gate_up, down = (_weights(QKV, HIDDEN), _weights(HIDDEN, HIDDEN), _weights(2 * INTER, HIDDEN),
                             _weights(HIDDEN, INTER))  # fmt: skip
    stacked = tuple(torch.cat(parts) for parts in zip(qkv, o, gate_up, strict=True))
    x = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16)
    xi = torch.randn(m, INTER, device="cuda", dtype=torch.bfloat16)
    xq, xiq = quantize_rows(x), quantize_rows(xi)
    split = m == 1  # the engine's decode partials: o and down in two K slices at one row, o alone past it

    def down_product() -> torch.Tensor:
        return fp8_partials(xi, *down, 2, xiq) if split else fp8_linear(xi, *down, x_codes=xiq)

    def chain() -> None:
        fp8_linear(x, *qkv, x_codes=xq)
        fp8_partials(x, *o, 2, xq)
        fp8_gated(x, *gate_up, xq)
        down_product()

    def one_stream() -> None:
        fp8_linear(x, *stacked, x_codes=xq)
        down_product()

    weight_bytes = sum(w.numel() for w, _ in (qkv, o, gate_up, down))
    parts = {
        "qkv": graphed(lambda: fp8_linear(x, *qkv, x_codes=xq)),
        "o": graphed(lambda: fp8_partials(x, *o, 2, xq)),
        "gate_up": graphed(lambda: fp8_gated(x, *gate_up, xq)),
        "down": graphed(down_product),
        "stacked_k4096": graphed(lambda: fp8_linear(x, *stacked, x_codes=xq)),
    }
    row = {
        "M": m,
        "chain_us": 1e3 * bench_ms(graphed(chain)),
        "chain_clean_us": bench_clean_us(graphed(chain)),
        "stacked_us": 1e3 * bench_ms(graphed(one_stream)),
        "bytes_us": weight_bytes / (copy_tbps * 1e6),
        "parts_us": {name: 1e3 * bench_ms(run) for name, run in parts.items()},
        "parts_clean_us": {name: bench_clean_us(run) for name, run in parts.items()},
    }
    print(
        f"M={m}: chain {row['chain_us']:.1f} us (after a clean flush {row['chain_clean_us']:.1f}), "
        f"one stream + down {row['stacked_us']:.1f}, bytes "
        f"{row['bytes_us']:.1f}; parts "
        + ", ".join(f"{k} {v:.1f}" for k, v in row["parts_us"].items())
        + "; after clean flushes "
        + ", ".join(f"{k} {v:.1f}" for k, v in row["parts_clean_us"].items()),
        flush=True,
    )
    return row


@triton.jit
def _read_kernel(w_ptr, out_ptr, K, stride_wn, BN: tl.constexpr, BK: tl.constexpr, TILED: tl.constexpr,
                 STAGES: tl.constexpr):  # fmt: skip
    """Program n reads rows [n BN, n BN + BN) over all of K, a [BN, BK] tile a step, and sums them."""
    pid = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, BN)
    c = tl.arange(0, BK)
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    steps = K // BK
    for s in tl.range(0, steps, num_stages=STAGES):
        if TILED:  # [N / BN, K / BK, BN, BK]: a step's tile is one contiguous block
            ptr = w_ptr + (pid * steps + s) * (BN * BK) + r[:, None] * BK + c[None, :]
        else:
            ptr = w_ptr + (pid * BN + r)[:, None] * stride_wn + s * BK + c[None, :]
        acc += tl.load(ptr).to(tl.float32)
    tl.store(out_ptr + pid * BN + r, tl.sum(acc, 1))


def _codes(n: int, k: int) -> torch.Tensor:
    """Random e4m3 codes [n, k] without NaN (bit patterns 0-99)."""
    return torch.randint(0, 100, (n, k), device="cuda", dtype=torch.int8).view(torch.float8_e4m3fn)


def _reader(
    src: torch.Tensor, n: int, k: int, tile: tuple[int, int, int], tiled: bool = False
) -> Callable[[], object]:
    """The graphed bare read of ``n`` x ``k`` codes in [BN, BK] tiles with ``tile``'s stages."""
    bn, bk, stages = tile
    out = torch.empty(n, device="cuda", dtype=torch.float32)

    def run() -> None:
        _read_kernel[(n // bn,)](src, out, k, k, BN=bn, BK=bk, TILED=tiled, STAGES=stages)

    return graphed(run)


def _read_us(src: torch.Tensor, n: int, k: int, tile: tuple[int, int, int], tiled: bool = False) -> float:
    """us of the bare read (``_reader``), L2 flushed by ``bench_ms``."""
    return 1e3 * bench_ms(_reader(src, n, k, tile, tiled))


def _line(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y against x."""
    slope = float(((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum())
    return float(y.mean() - slope * x.mean()), slope


def layouts(copy_tbps: float) -> list[dict]:
    """Read rates of the row-major and the tile-by-tile layouts (``--layouts``)."""
    big = torch.ones(1 << 29, device="cuda", dtype=torch.float32)  # 2 GiB: torch's reduction, read only
    rows = [{"layout": "torch_sum_2GiB", "TBps": big.numel() * 4 / (bench_ms(big.sum) * 1e9)}]
    print(f"read torch.sum over 2 GiB: {rows[0]['TBps']:.2f} TB/s", flush=True)
    del big
    n, k = QKV + HIDDEN + 2 * INTER, HIDDEN
    w = _codes(n, k)
    for bn, bk, stages in ((32, 256, 6), (16, 256, 6), (64, 256, 4), (32, 512, 4)):
        tiled = w.view(n // bn, bn, k // bk, bk).transpose(1, 2).contiguous()
        for name, src in (("row_major", w), ("tiled", tiled)):
            us = _read_us(src, n, k, (bn, bk, stages), name == "tiled")
            rows.append({"tile": [bn, bk, stages], "layout": name, "us": us, "TBps": n * k / us / 1e6})
            print(f"read {bn}x{bk}x{stages} {name}: {us:.1f} us, {n * k / us / 1e6:.2f} TB/s "
                  f"(copy rate {copy_tbps:.2f})", flush=True)  # fmt: skip
    return rows


def _size_point(n: int, k: int) -> dict:
    """The bare read of ``n`` x ``k`` codes after each flush, and torch's int32 sum of them, us."""
    codes = _codes(n, k)
    sink = torch.empty((), device="cuda", dtype=torch.int64)
    words = codes.view(torch.int32)
    mb = n * k / 1e6
    flat = words.view(-1)
    clean = bench_clean_us(_reader(codes, n, k, (32, 512, 4)))
    row = {"MB": mb, "us": _read_us(codes, n, k, (32, 512, 4)), "clean_us": clean,
           "torch_sum_clean_us": bench_clean_us(graphed(lambda: torch.sum(flat, 0, out=sink)))}  # fmt: skip
    print(f"read {mb:8.1f} MB: {row['us']:8.1f} us ({mb / row['us']:.2f} TB/s); after a clean flush "
          f"{row['clean_us']:8.1f} us ({mb / row['clean_us']:.2f}); torch's sum after one "
          f"{row['torch_sum_clean_us']:8.1f} us ({mb / row['torch_sum_clean_us']:.2f})",
          flush=True)  # fmt: skip
    return row


def sizes(copy_tbps: float) -> list[dict]:
    """The bare read (32 x 512 tiles, 4 stages) over 16 MB to 2 GiB of e4m3 (``--sizes``): a launch's
    fixed cost and the rate it tends to, from a least-squares line through time against bytes; each
    size also after a clean flush, and torch's int32 sum of the same bytes after one."""
    k = HIDDEN
    sizes_mb = (16, 32, 64, 128, 159, 256, 512, 1024, 2048)
    rows = [_size_point((mb << 20) // k // 32 * 32, k) for mb in sizes_mb]
    x = torch.tensor([r["MB"] for r in rows], dtype=torch.float64)
    fits: dict = {}
    for key in ("us", "clean_us", "torch_sum_clean_us"):
        fixed, slope = _line(x, torch.tensor([r[key] for r in rows], dtype=torch.float64))
        fit = {"fixed_us": fixed, "TBps_asymptote": 1 / slope}
        if key == "us":  # do_bench's fit at the top, as the result files have it
            fits.update(fit)
        else:
            fits[key] = fit
        print(
            f"fit {key}: {fixed:.1f} us a launch + bytes at {1 / slope:.2f} TB/s (copy rate {copy_tbps:.2f})"
        )
    return [*rows, fits]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--out", default=None)
    ap.add_argument("--layouts", action="store_true", help="read rates of two weight layouts too")
    ap.add_argument("--sizes", action="store_true", help="the bare read over 16 MB to 2 GiB, and a fit")
    args = ap.parse_args()
    copy_tbps, _ = measure_ceilings(torch.device("cuda"))
    rows = [point(m, copy_tbps) for m in args.rows]
    reads = (layouts(copy_tbps) if args.layouts else []) + (sizes(copy_tbps) if args.sizes else [])
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**run_info(), "copy_TBps": copy_tbps, "rows": rows, "layouts": reads}, f, indent=1)


if __name__ == "__main__":
    main()
