"""Probe: how fast can the shared prefix's inner loop run? (kernel variants, one segment, TMA tiles).

Not the engine's kernel: a stripped copy of its contiguous-prefix loop (rows of stacked queries against
one segment's KV, one KV head per program column) with switches, to measure where the time goes before
changing ``shared_attention.py``. Variants (``MODE``):
  0 as shipped: QK, softmax, PV in order
  1 no exponential (wrong values): the MUFU share of the loop
  2 QK of the next tile issued before the softmax of this one (FA3's intra-warpgroup overlap)
  3 half of each tile's exponentials as a degree-3 polynomial on the FMA pipe (FA4's trick)
  4 = 2 and 3

Usage (GPU): PYTHONPATH=. python benchmarks/prefix_probe.py [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from prefixserve.attention.kernels.paged_attention import finish_rows


@triton.jit
def exp2_poly(x):
    """2^x for x <= 0 on the FMA pipe: 2^floor(x) by exponent bits times a cubic for 2^frac."""
    x = tl.maximum(x, -127.0)
    xi = tl.floor(x)
    f = x - xi
    # minimax cubic for 2^f on [0, 1): max relative error about 1e-4 (P is rounded to bf16 anyway)
    p = 0.0779120556 * f + 0.2259564611
    p = p * f + 0.6960230104
    p = p * f + 0.9998915627
    bits = p.to(tl.int32, bitcast=True) + (xi.to(tl.int32) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def exp2_mixed(x, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """2^x with half the columns on MUFU and half on the FMA polynomial."""
    a, b = tl.split(tl.reshape(x, [BLOCK_M, BLOCK_N // 2, 2]))
    return tl.reshape(tl.join(tl.exp2(a), exp2_poly(b)), [BLOCK_M, BLOCK_N])


@triton.jit
def soft(s, m_i, l_i, qk_scale, MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    x = s * qk_scale - m_new[:, None]
    if MODE == 1:
        p = x
    elif MODE == 3 or MODE == 4:
        p = exp2_mixed(x, BLOCK_M, BLOCK_N)
    else:
        p = tl.exp2(x)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _probe_kernel(
    q_ptr,  # [H, M, D]
    k_desc,  # [N, Hkv * D] rows
    v_desc,
    o_ptr,  # [H, M, D] fp32
    lse_ptr,  # [H, M]
    M,
    N,
    qk_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MODE: tl.constexpr,
):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (h * M + offs_m)[:, None] * HEAD_DIM + offs_d[None, :])
    col = h * HEAD_DIM
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if MODE == 2 or MODE == 4:
        s = tl.dot(q, tl.trans(k_desc.load([0, col])))
        for start in range(BLOCK_N, N, BLOCK_N):
            s_next = tl.dot(q, tl.trans(k_desc.load([start, col])))
            p, alpha, m_i, l_i = soft(s, m_i, l_i, qk_scale, MODE, BLOCK_M, BLOCK_N)
            v = v_desc.load([start - BLOCK_N, col])
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            s = s_next
        p, alpha, m_i, l_i = soft(s, m_i, l_i, qk_scale, MODE, BLOCK_M, BLOCK_N)
        v = v_desc.load([N - BLOCK_N, col])
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    else:
        for start in range(0, N, BLOCK_N):
            s = tl.dot(q, tl.trans(k_desc.load([start, col])))
            p, alpha, m_i, l_i = soft(s, m_i, l_i, qk_scale, MODE, BLOCK_M, BLOCK_N)
            v = v_desc.load([start, col])
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    o, lse = finish_rows(m_i, l_i, acc)
    tl.store(o_ptr + (h * M + offs_m)[:, None] * HEAD_DIM + offs_d[None, :], o)
    tl.store(lse_ptr + h * M + offs_m, lse)


def run_variant(q, k, v, mode: int, block_m: int, block_n: int, stages: int, warps: int):
    """(o, lse, launch fn) of one compiled variant."""
    heads, rows, dim = q.shape
    n = k.shape[0]
    kd = TensorDescriptor.from_tensor(k.view(n, -1), [block_n, dim])
    vd = TensorDescriptor.from_tensor(v.view(n, -1), [block_n, dim])
    o = torch.empty(heads, rows, dim, device=q.device, dtype=torch.float32)
    lse = torch.empty(heads, rows, device=q.device, dtype=torch.float32)
    scale = dim**-0.5 * 1.4426950408889634

    def launch():
        _probe_kernel[(rows // block_m, heads)](
            q, kd, vd, o, lse, rows, n, scale, block_m, block_n, dim, mode, num_warps=warps, num_stages=stages
        )

    launch()
    return o, lse, launch


def reference(q, k, v):
    """fp32 attention of every row over the whole segment: (o, lse)."""
    heads, _, dim = q.shape
    kk = k.float().view(-1, heads, dim).transpose(0, 1)
    vv = v.float().view(-1, heads, dim).transpose(0, 1)
    s = q.float() @ kk.transpose(1, 2) * dim**-0.5
    return torch.softmax(s, -1) @ vv, torch.logsumexp(s, -1)


def engine_probe(batch: int = 1024, prefix: int = 16384) -> list[dict]:
    """The engine's shared kernel (``launch_shared``) at num_stages 2 / 3, tail pipelined or not."""
    import numpy as np

    from prefixserve.attention.kernels import paged_attention as pa
    from prefixserve.attention.kernels import shared_attention as sa
    from prefixserve.attention.kernels.launch import relaunch

    dev = torch.device("cuda")
    nb = prefix // 16
    k_cache = torch.randn(nb, 16, 8, 128, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(batch, 32, 128, device=dev, dtype=torch.bfloat16)
    seg_blocks = torch.arange(nb, dtype=torch.int32, device=dev)
    bstart = torch.tensor([0, nb], dtype=torch.int32, device=dev)
    rows = torch.arange(batch, dtype=torch.int32, device=dev)
    out, ref = [], None
    flops = 4 * 32 * 128 * batch * prefix
    orig = sa.launch_fitting
    for stages, tail in ((2, None), (2, 1), (3, None), (3, 1)):
        pa._FALLBACK.clear()
        work = sa.plan_shared_work(
            [0, batch],
            [prefix],
            8,
            4,
            dev,
            num_stages=stages,
            seg_blocks=np.arange(nb),
            seg_block_start=[0, nb],
            block_size=16,
        )
        o = torch.zeros(work.num_slots, 32, 128, device=dev)
        lse = torch.zeros(work.num_slots, 32, device=dev)
        sa.launch_fitting = lambda *a, _t=tail, **kw: orig(*a, TAIL_STAGES=_t, **kw)
        try:
            launch = sa.launch_shared(q, k_cache, v_cache, seg_blocks, bstart, rows, work, 0.088, o, lse)
        finally:
            sa.launch_fitting = orig
        ck = launch.compiled
        again = lambda lc=launch: relaunch(lc, [])  # noqa: E731
        ms = triton.testing.do_bench(again, warmup=10, rep=100, return_mode="median")
        ref = o.clone() if ref is None else ref
        out.append(
            {
                "stages_asked": stages,
                "tail_stages": tail,
                "stages_ran": launch.options.get("num_stages"),
                "block_n": launch.args[launch.num_positional + launch.keywords.index("BLOCK_N")],
                "tma": work.tma,
                "items": int(work.items.shape[0]),
                "smem": getattr(ck, "metadata", None) and ck.metadata.shared,
                "regs": getattr(ck, "n_regs", None),
                "spills": getattr(ck, "n_spills", None),
                "ms": ms,
                "tflops": flops / ms / 1e9,
                "max_diff_vs_first": (o - ref).abs().max().item(),
            }
        )
    return out


def tile_grid(points, variants) -> list[dict]:
    """The whole decode attention call (graphed, shared kernel on the side stream) per TMA tile table.

    More stages speed the compute-bound prefix but take the shared memory that lets the own kernel
    run beside it, so the choice is timed on the whole call, not the prefix kernel alone.
    """
    from benchmarks.attention import Case, _bench, graphed
    from prefixserve.attention.kernels import paged_attention as pa
    from prefixserve.attention.kernels import shared_attention as sa

    dev = torch.device("cuda")
    keep = (sa.SHARED_TALL_TMA, sa.SHARED_SHORT_TMA, sa.num_sms)
    out = []
    for b, p, s in points:
        case = Case(b, p, s, dev)
        row = {"B": b, "P": p, "S": s}
        for name, (tall, short, *per_sm) in variants.items():
            sa.SHARED_TALL_TMA, sa.SHARED_SHORT_TMA = tall, short
            if per_sm:  # programs per SM the split aims at (plan_shared_work targets 2 x num_sms)
                sa.num_sms = lambda d, _f=per_sm[0]: int(keep[2](d) * _f / 2)
            pa._FALLBACK.clear()
            try:
                row[name] = _bench(graphed(case.backend("triton", overlap=True)[0]))
            finally:
                sa.SHARED_TALL_TMA, sa.SHARED_SHORT_TMA, sa.num_sms = keep
        out.append(row)
        print("  " + json.dumps(row), flush=True)
        del case
        torch.cuda.empty_cache()
    return out


def fused_grid(points, shares) -> list[dict]:
    """The whole decode attention call (graphed): two kernels on two streams vs the fused launch."""
    from benchmarks.attention import Case, _bench, graphed
    from prefixserve.attention.kernels import fused_attention as fa
    from prefixserve.attention.kernels.triton_backend import TritonBackend

    dev = torch.device("cuda")
    rule = fa.own_share
    out = []
    for b, p, s in points:
        case = Case(b, p, s, dev)
        row: dict = {"B": b, "P": p, "S": s}
        outs = {}
        for name, share in [("split", None), ("fused_rule", None)] + [(f"fused_{k}", k) for k in shares]:
            TritonBackend.fused = name != "split"
            if share is not None:
                fa.own_share = lambda *a, _k=share: _k
            try:
                fn = case.backend("triton", overlap=True)[0]
                outs[name] = fn().float()
                row[name] = _bench(graphed(fn))
            except Exception as exc:
                row[name] = repr(exc)[:200]
            finally:
                fa.own_share = rule
                TritonBackend.fused = True
        if "split" in outs:
            row["max_diff"] = max((o - outs["split"]).abs().max().item() for o in outs.values())
        out.append(row)
        print("  " + json.dumps(row), flush=True)
        del case
        torch.cuda.empty_cache()
    return out


def _overlap_variant(case, sms: int, variant: dict, parts: bool) -> dict:
    """One variant of ``overlap_grid`` at one point: its graphed call time, output, and parts' times.

    ``variant`` keys (absent = the engine's rule): ``splits="old"`` (tall tiles split for two programs
    per SM, before ``wave_splits``), ``pack`` (own-kernel sequences per program), ``merge`` (merge
    elements per program), ``gluon`` (False: the Triton shared kernel on Hopper too), ``persist``
    (a persistent shared grid of n programs, n < 0: SMs + n, 0: the full grid; the other SMs run the
    own kernel), ``priority`` (the side stream's priority), ``mixed`` (True / False: the mixed launch or not),
    ``ht`` (KV heads per own ticket of the mixed kernel; 0: ``own_tiling``'s).
    """
    from benchmarks.attention import _bench, graphed, time_launches
    from prefixserve.attention.kernels import merge as mg
    from prefixserve.attention.kernels import mixed_gluon
    from prefixserve.attention.kernels import paged_attention as pa
    from prefixserve.attention.kernels import shared_attention as sa
    from prefixserve.attention.kernels import shared_gluon as sg
    from prefixserve.attention.kernels import triton_backend as tb

    keep = (sa.wave_splits, tb.TritonBackend.own_pack, mg.MERGE_ELEMENTS, sg.ENABLED, sa.plan_shared_work)
    keep_mixed, keep_ht = tb.TritonBackend.mixed, mixed_gluon.FORCE_HT
    tb.TritonBackend.mixed = variant.get("mixed", keep_mixed)
    mixed_gluon.FORCE_HT = variant.get("ht", keep_ht)
    keep_priority = tb.SIDE_PRIORITY
    tb.SIDE_PRIORITY = variant.get("priority", keep_priority)
    sg.ENABLED = variant.get("gluon", keep[3])
    if "persist" in variant:  # n persistent shared programs (< 0: SMs minus that; 0: the full grid)
        n = variant["persist"] if variant["persist"] >= 0 else sms + variant["persist"]
        sa.plan_shared_work = lambda *a, _n=n, **kw: keep[4](*a, **{**kw, "programs": _n})
    if variant.get("splits") == "old":
        sa.wave_splits = lambda base, slots, kmax, *a: max(1, min(kmax, -(-2 * sms // max(1, base))))
    tb.TritonBackend.own_pack = variant.get("pack")
    mg.MERGE_ELEMENTS = variant.get("merge", keep[2])
    pa._FALLBACK.clear()
    try:
        be = tb.TritonBackend()
        be.overlap_min_rows = 0
        meta = dataclasses.replace(case.meta, plan=None, stats={})
        be.prepare(meta)

        def call():
            return be.forward(case.q, case.k_cache, case.v_cache, meta, case.scale)

        res = {"o": call().float(), "ms": round(_bench(graphed(call)), 4)}
        lay = next(iter(meta.plan.layouts.values()))
        res["plan"] = {
            "programs": lay.work.programs,
            "items": int(lay.work.items.shape[0]),
            "pack": lay.own_pack,
            "mixed": lay.mixed,
        }
        if parts:
            tensors = (case.q, case.k_cache, case.v_cache, torch.empty_like(case.q))
            res["parts"] = time_launches(lay.launches, tensors)
        return res
    finally:
        sa.wave_splits, tb.TritonBackend.own_pack, mg.MERGE_ELEMENTS, sg.ENABLED, sa.plan_shared_work = keep
        tb.SIDE_PRIORITY = keep_priority
        tb.TritonBackend.mixed, mixed_gluon.FORCE_HT = keep_mixed, keep_ht


# (variant, time the parts too)
OVERLAP_VARIANTS = {
    "before": ({"splits": "old", "pack": 1}, True),
    "wave": ({"pack": 1}, True),
    "rules": ({}, True),
    "rules_triton": ({"gluon": False}, True),
    "rules_full": ({"persist": 0}, False),
    "rules_nopri": ({"priority": 0}, False),
    "split": ({"mixed": False}, True),  # shared kernel + own kernel + merge
    "mixed": ({"mixed": True}, True),  # shared and own tiles in one launch (mixed_gluon.py) + merge
    "mixed_ht1": ({"mixed": True, "ht": 1}, True),  # own tickets of one KV head, not two (NOTES.md v11)
    **{f"persist{n}": ({"persist": n}, False) for n in (16, 24, 32, 48, 64, 96)},
}


def overlap_grid(points, variants: list[str] | None = None) -> list[dict]:
    """The whole decode call (graphed) per ``OVERLAP_VARIANTS``: the shared kernel on a persistent
    grid (the SMs it leaves free run the own kernel beside it), the own kernel packing sequences,
    the merge's program size.

    Also times each recorded launch alone (shared, own, merge), so the overlap can be read off:
    the call vs the sum and the max of its parts.
    """
    from benchmarks.attention import Case
    from prefixserve.attention.kernels import shared_attention as sa

    dev = torch.device("cuda")
    sms = sa.num_sms(dev)
    out = []
    for b, p, s in points:
        case = Case(b, p, s, dev)
        row: dict = {"B": b, "P": p, "S": s, "sms": sms}
        ref = None
        for name, (variant, parts) in OVERLAP_VARIANTS.items():
            if variants and name not in variants:
                continue
            try:
                res = _overlap_variant(case, sms, variant, parts)
            except Exception as exc:
                row[name] = repr(exc)[:200]
                continue
            ref = res["o"] if ref is None else ref
            row[name] = res["ms"]
            row[name + "_diff"] = float((res["o"] - ref).abs().max())
            row[name + "_plan"] = res["plan"]
            if "parts" in res:
                row[name + "_parts"] = res["parts"]
        out.append(row)
        print("  " + json.dumps(row), flush=True)
        del case
        torch.cuda.empty_cache()
    return out


def _segment_case(batch: int, prefix: int, segments: int = 1, tail: int = 0):
    """Stacked rows of ``segments`` contiguous prefixes of ``prefix + tail`` tokens, B rows each."""
    import numpy as np

    dev = torch.device("cuda")
    tokens = prefix + tail
    nb_seg = -(-tokens // 16)
    nb = nb_seg * segments + 8  # a few blocks past the last segment: the ragged tail reads them
    k_cache = torch.randn(nb, 16, 8, 128, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(batch * segments, 32, 128, device=dev, dtype=torch.bfloat16)
    seg_blocks = np.arange(nb_seg * segments)
    bstart = [g * nb_seg for g in range(segments + 1)]
    row_start = [g * batch for g in range(segments + 1)]
    return {
        "q": q,
        "k": k_cache,
        "v": v_cache,
        "seg_blocks": torch.tensor(seg_blocks, dtype=torch.int32, device=dev),
        "seg_blocks_host": seg_blocks,
        "bstart": torch.tensor(bstart, dtype=torch.int32, device=dev),
        "bstart_host": bstart,
        "rows": torch.randperm(batch * segments, device=dev).to(torch.int32),
        "row_start": row_start,
        "tokens": [tokens] * segments,
    }


def gluon_grid(points, variants) -> list[dict]:
    """Shared kernel alone: the engine's Triton kernel vs the warp-specialised Gluon kernel, same work.

    Each point checks the Gluon partials against the Triton kernel's (max abs diff of o and lse, and
    of the merged rows against an fp32 reference when the case is small).
    """
    from prefixserve.attention.kernels import shared_attention as sa
    from prefixserve.attention.kernels import shared_gluon as sg
    from prefixserve.attention.kernels.launch import relaunch

    dev = torch.device("cuda")
    out = []
    for batch, prefix, segments, tail in points:
        c = _segment_case(batch, prefix, segments, tail)
        work = sa.plan_shared_work(
            c["row_start"],
            c["tokens"],
            8,
            4,
            dev,
            seg_blocks=c["seg_blocks_host"],
            seg_block_start=c["bstart_host"],
            block_size=16,
        )
        flops = 4 * 32 * 128 * batch * segments * (prefix + tail)
        o_t = torch.zeros(work.num_slots, 32, 128, device=dev)
        l_t = torch.zeros(work.num_slots, 32, device=dev)
        enabled, sg.ENABLED = sg.ENABLED, False  # the Triton kernel for the reference column
        try:
            launch = sa.launch_shared(
                c["q"], c["k"], c["v"], c["seg_blocks"], c["bstart"], c["rows"], work, 0.088, o_t, l_t
            )
        finally:
            sg.ENABLED = enabled
        ms = triton.testing.do_bench(
            lambda lc=launch: relaunch(lc, []), warmup=10, rep=100, return_mode="median"
        )
        row = {"B": batch, "P": prefix, "segments": segments, "tail": tail, "items": int(work.items.shape[0])}
        row["triton_ms"] = ms
        row["triton_tflops"] = flops / ms / 1e9
        for name, (stages, overlap) in variants.items():
            o_g = torch.full_like(o_t, float("nan"))
            l_g = torch.full_like(l_t, float("nan"))
            try:
                glaunch = sg.launch_shared_gluon(
                    c["q"], c["k"], c["v"], c["rows"], work.items, o_g, l_g, 0.088, stages, overlap
                )
                torch.cuda.synchronize()
                gms = triton.testing.do_bench(
                    lambda lc=glaunch: relaunch(lc, []), warmup=10, rep=100, return_mode="median"
                )
                row[f"{name}_ms"] = gms
                row[f"{name}_tflops"] = flops / gms / 1e9
                row[f"{name}_vs_triton"] = ms / gms
                row[f"{name}_o_diff"] = (o_g - o_t).abs().max().item()
                row[f"{name}_lse_diff"] = (l_g - l_t).abs().max().item()
            except Exception as exc:
                row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
        print(row, flush=True)
        out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--fused", action="store_true", help="two kernels vs the fused launch")
    parser.add_argument("--grid", action="store_true", help="time TMA tile tables on the whole call")
    parser.add_argument("--overlap", action="store_true", help="persistent shared grid x packed own kernel")
    parser.add_argument("--gluon", action="store_true", help="Triton vs warp-specialised Gluon shared kernel")
    parser.add_argument("--variants", default="", help="--overlap: comma-separated OVERLAP_VARIANTS names")
    args = parser.parse_args()
    if args.gluon:
        points = [(1024, 16384, 1, 0), (256, 16384, 1, 0), (1024, 4096, 1, 0), (256, 4096, 1, 0)]
        points += [(64, 16384, 1, 0), (1024, 1024, 1, 0), (96, 1000, 3, 48), (130, 300, 2, 16)]
        variants = {
            # (stages, QK(j+1) before softmax(j)); the one-partition variants of NOTES.md v7 are gone
            "s3": (3, False),
            "s3o": (3, True),
            "s2o": (2, True),
        }
        grid = gluon_grid(points, variants)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gluon_grid.json").write_text(json.dumps(grid, indent=1))
        return
    if args.overlap:
        points = [(1024, 16384, 512), (1024, 16384, 128), (1024, 4096, 128), (1024, 4096, 512)]
        points += [
            (1024, 1024, 128),
            (1024, 1024, 512),
            (256, 4096, 512),
            (256, 1024, 512),
            (256, 16384, 512),
            (256, 16384, 128),
        ]
        grid = overlap_grid(points, [v for v in args.variants.split(",") if v])
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "overlap_grid.json").write_text(json.dumps(grid, indent=1))
        return
    if args.fused:
        points = [(1024, 16384, 128), (1024, 16384, 512), (256, 16384, 512), (1024, 4096, 128)]
        points += [(1024, 4096, 512), (256, 4096, 512), (64, 16384, 512), (16, 16384, 512), (1024, 1024, 512)]
        grid = fused_grid(points, (8, 24, 48))
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "fused_grid.json").write_text(json.dumps(grid, indent=1))
        return
    if args.grid:
        points = [(b, p, s) for b in (16, 64) for p in (4096, 16384) for s in (128, 512)]
        variants = {
            "short64x3": ((128, 3), (64, 3)),
            "short128x2": ((128, 3), (128, 2)),
            "short128x3": ((128, 3), (128, 3)),
            "short32x4": ((128, 3), (32, 4)),
            "short64x3_1sm": ((128, 3), (64, 3), 1),
            "short64x3_3sm": ((128, 3), (64, 3), 3),
            "short128x2_1sm": ((128, 3), (128, 2), 1),
        }
        grid = tile_grid(points, variants)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "tile_grid.json").write_text(json.dumps(grid, indent=1))
        return
    torch.manual_seed(0)
    dev = "cuda"
    heads, dim = 8, 128  # one query head per program row here: rows = B x G stacked
    configs = [(128, 128, 2, 8), (128, 64, 3, 8), (128, 128, 3, 8), (128, 64, 4, 8), (64, 128, 3, 4)]
    # correctness at a small size
    q = torch.randn(heads, 512, dim, device=dev, dtype=torch.bfloat16)
    k = torch.randn(2048, heads, dim, device=dev, dtype=torch.bfloat16)
    v = torch.randn(2048, heads, dim, device=dev, dtype=torch.bfloat16)
    ro, rl = reference(q, k, v)
    errors = {}
    for mode in (0, 2):
        for bm, bn, st, w in configs:
            try:
                o, lse, _ = run_variant(q, k, v, mode, bm, bn, st, w)
                err = ((o - ro).norm() / ro.norm()).item()
                errors[f"{mode}/{bm}x{bn}x{st}"] = (err, (lse - rl).abs().max().item())
            except Exception as exc:
                errors[f"{mode}/{bm}x{bn}x{st}"] = repr(exc)[:200]
    # timing at B=1024 rows x G=4, P=16K
    rows, n = 4096, 16384
    q = torch.randn(heads, rows, dim, device=dev, dtype=torch.bfloat16)
    k = torch.randn(n, heads, dim, device=dev, dtype=torch.bfloat16)
    v = torch.randn(n, heads, dim, device=dev, dtype=torch.bfloat16)
    flops = 4 * heads * rows * n * dim
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    gemm_ms = triton.testing.do_bench(lambda: a @ a, warmup=10, rep=100, return_mode="median")
    gemm = 2 * 8192**3 / gemm_ms / 1e9
    results = []
    for mode in (0, 1, 2):
        for bm, bn, st, w in configs:
            key = f"{mode}/{bm}x{bn}x{st}"
            try:
                _, _, launch = run_variant(q, k, v, mode, bm, bn, st, w)
                ms = triton.testing.do_bench(launch, warmup=10, rep=100, return_mode="median")
                tf = flops / ms / 1e9
                results.append({"variant": key, "ms": ms, "tflops": tf, "of_gemm": tf / gemm})
            except Exception as exc:
                results.append({"variant": key, "error": repr(exc)[:300]})
    engine = engine_probe()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    out = {"gemm_tflops": gemm, "errors": errors, "results": results, "engine": engine}
    (Path(args.out) / "prefix_probe.json").write_text(json.dumps(out, indent=1))
    print("errors (rel L2 of o, max |dlse|):")
    for key, val in errors.items():
        print(f"  {key}: {val}")
    print(f"GEMM {gemm:.0f} TFLOP/s; B=1024 x G=4 rows, P=16K, 8 heads, d=128 ({flops / 1e9:.0f} GFLOP)")
    for r in results:
        if "error" in r:
            print(f"  {r['variant']:>16}  ERROR {r['error']}")
        else:
            print(f"  {r['variant']:>16}  {r['ms']:.3f} ms  {r['tflops']:.0f} TFLOP/s  {r['of_gemm']:.0%}")
    print("engine shared kernel, B=1024, P=16K (with its KV splits):")
    for r in engine:
        print("  " + json.dumps(r))


if __name__ == "__main__":
    main()
