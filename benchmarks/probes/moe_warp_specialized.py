"""Scratch probe (kept for the record in docs/kernels.md §4, removed in the next commit): warp-specialised expert
GEMMs (x gathered by expert first, TMA for every operand) against the shipped kernels at B=512/1024."""

import json
import os
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from prefixserve.model.kernels import fused_moe as fm
from prefixserve.model.kernels.fused_moe import _act


@triton.jit
def gather_rows(
    x_ptr,
    xs_ptr,
    slots_ptr,
    block_rows_ptr,
    hidden,
    stride_x,
    TOP_K: tl.constexpr,
    BM: tl.constexpr,
    BH: tl.constexpr,
):
    blk = tl.program_id(0)
    r = tl.arange(0, BM)
    real = r < tl.load(block_rows_ptr + blk)
    tok = (tl.load(slots_ptr + blk * BM + r, mask=real, other=0) // TOP_K).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    v = tl.load(
        x_ptr + tok[:, None] * stride_x + h[None, :], mask=real[:, None] & (h < hidden)[None, :], other=0.0
    )
    row = blk.to(tl.int64) * BM + r
    tl.store(xs_ptr + row[:, None] * hidden + h[None, :], v, mask=(h < hidden)[None, :])


@triton.jit
def up_ws(
    xs_desc,
    w_desc,
    inter_ptr,
    block_expert_ptr,
    block_rows_ptr,
    hidden,
    inter,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    WS: tl.constexpr,
):
    blk = tl.program_id(0)
    r = tl.arange(0, BM)
    expert = tl.load(block_expert_ptr + blk)
    real = r < tl.load(block_rows_ptr + blk)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    row0 = tl.maximum(expert, 0) * 2 * inter + tl.program_id(1) * BN
    acc_g = tl.zeros([BM, BN], dtype=tl.float32)
    acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    kend = tl.where(expert >= 0, hidden, 0)
    for k0 in tl.range(0, kend, BK, warp_specialize=WS):
        xs = xs_desc.load([blk * BM, k0])
        wg = w_desc.load([row0, k0])
        wu = w_desc.load([row0 + inter, k0])
        acc_g = tl.dot(xs, wg.T, acc_g)
        acc_u = tl.dot(xs, wu.T, acc_u)
    dtype = inter_ptr.dtype.element_ty
    out = _act(acc_g, acc_u, dtype, 0, 1.0, 1.0)
    row = blk.to(tl.int64) * BM + r
    tl.store(
        inter_ptr + row[:, None] * inter + n[None, :],
        out.to(dtype),
        mask=real[:, None] & (n < inter)[None, :],
    )


@triton.jit
def down_ws(
    a_desc,
    w_desc,
    weights_ptr,
    out_ptr,
    slots_ptr,
    block_expert_ptr,
    block_rows_ptr,
    hidden,
    inter,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    WS: tl.constexpr,
):
    blk = tl.program_id(0)
    r = tl.arange(0, BM)
    expert = tl.load(block_expert_ptr + blk)
    real = r < tl.load(block_rows_ptr + blk)
    assign = tl.load(slots_ptr + blk * BM + r, mask=real, other=0).to(tl.int64)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    w_row0 = tl.maximum(expert, 0) * hidden + tl.program_id(1) * BN
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    kend = tl.where(expert >= 0, inter, 0)
    for k0 in tl.range(0, kend, BK, warp_specialize=WS):
        a = a_desc.load([blk * BM, k0])
        w = w_desc.load([w_row0, k0])
        acc = tl.dot(a, w.T, acc)
    dtype = out_ptr.dtype.element_ty
    acc = acc.to(dtype).to(tl.float32)
    weight = tl.load(weights_ptr + assign, mask=real, other=0.0)
    out = acc * weight[:, None]
    tl.store(
        out_ptr + assign[:, None] * hidden + n[None, :],
        out.to(dtype),
        mask=real[:, None] & (n < hidden)[None, :],
    )


def ws_forward(x, w_up, w_down, weights, ids, tile):
    bm, bnu, bnd, bk, warps, stages, ws = tile
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    inter = w_down.shape[1]
    experts = w_down.shape[0] // hidden
    n = tokens * top_k
    slots, block_expert, block_rows = fm.align(ids.view(-1), experts, bm)
    blocks = block_expert.shape[0]
    xs = torch.empty(blocks * bm, hidden, dtype=x.dtype, device=x.device)
    gather_rows[(blocks, triton.cdiv(hidden, 512))](
        x, xs, slots, block_rows, hidden, x.stride(0), TOP_K=top_k, BM=bm, BH=512, num_warps=4
    )
    inter_out = torch.empty(blocks * bm, inter, dtype=x.dtype, device=x.device)
    up_ws[(blocks, triton.cdiv(inter, bnu))](
        TensorDescriptor.from_tensor(xs, [bm, bk]),
        TensorDescriptor.from_tensor(w_up, [bnu, bk]),
        inter_out,
        block_expert,
        block_rows,
        hidden,
        inter,
        BM=bm,
        BN=bnu,
        BK=bk,
        WS=ws,
        num_warps=warps,
        num_stages=stages,
    )
    parts = torch.empty(n, hidden, dtype=x.dtype, device=x.device)
    dk = min(bk, 64)
    down_ws[(blocks, triton.cdiv(hidden, bnd))](
        TensorDescriptor.from_tensor(inter_out, [bm, dk]),
        TensorDescriptor.from_tensor(w_down, [bnd, dk]),
        weights.view(-1),
        parts,
        slots,
        block_expert,
        block_rows,
        hidden,
        inter,
        BM=bm,
        BN=bnd,
        BK=dk,
        WS=ws,
        num_warps=warps,
        num_stages=stages,
    )
    out = torch.empty_like(x)
    fm._combine_kernel[(tokens, triton.cdiv(hidden, 1024))](parts, out, hidden, TOP_K=top_k, BLOCK=1024)
    return out


def main():
    from benchmarks.harness.timing import bench_ms, graphed
    from benchmarks.moe import layer_weights
    from prefixserve.model.config import ModelConfig
    from prefixserve.model.loader import resolve_model

    cfg = ModelConfig.from_json(resolve_model("dummy:qwen3-30b-a3b").path)
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    gen, w_up, w_down, router = layer_weights(cfg)
    res = []
    for b in [int(v) for v in sys.argv[1:]] or [512, 1024]:
        x = torch.randn(b, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
        weights, ids = fm.route(x @ router.T, k, cfg.router_rule, cfg.norm_topk_prob)
        want = fm.experts_forward(x, w_up, w_down, weights, ids)
        base = bench_ms(graphed(lambda: fm.experts_forward(x, w_up, w_down, weights, ids)), 100)
        print(f"B={b} shipped {fm.tiles(b, k, e)} {base * 1e3:.1f} us", flush=True)
        row = {"B": b, "shipped_ms": base, "ws": []}
        bm0 = fm.tiles(b, k, e).bm
        cands = []
        cands = [
            (64, 64, 128, 64, 4, 3, False),
            (64, 64, 128, 64, 4, 3, True),
            (64, 128, 128, 64, 4, 3, True),
            (128, 128, 128, 64, 4, 3, True),
            (64, 64, 64, 64, 4, 4, True),
        ]
        for t in cands:
            print("  trying", t, flush=True)
            try:
                got = ws_forward(x, w_up, w_down, weights, ids, t)
                err = float((got.float() - want.float()).abs().max())
                ms = bench_ms(graphed(lambda: ws_forward(x, w_up, w_down, weights, ids, t)), 100)
            except Exception as exc:
                print(b, t, "fail", repr(exc)[:120], flush=True)
                continue
            print(f"   {t} {ms * 1e3:.1f} us ({base / ms:.3f}x) err {err:.3g}", flush=True)
            row["ws"].append({"tile": t, "ms": ms, "err": err})
        # the gather alone
        slots, be, br = fm.align(ids.view(-1), e, bm0)
        xs = torch.empty(be.shape[0] * bm0, cfg.hidden_size, dtype=x.dtype, device=x.device)
        g = bench_ms(
            graphed(
                lambda: gather_rows[(be.shape[0], triton.cdiv(cfg.hidden_size, 512))](
                    x, xs, slots, br, cfg.hidden_size, x.stride(0), TOP_K=k, BM=bm0, BH=512, num_warps=4
                )
            ),
            100,
        )
        print(f"   gather alone {g * 1e3:.1f} us", flush=True)
        row["gather_ms"] = g
        res.append(row)
    out = os.environ.get("OUT", ".")
    json.dump(res, open(f"{out}/ws_probe.json", "w"), indent=1)


if __name__ == "__main__":
    main()
