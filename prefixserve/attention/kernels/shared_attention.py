"""Shared-segment attention: every holder's query rows stacked against a segment's KV, read once per M-tile.

A segment (a run of whole KV blocks held by several sequences) is attended by its holders' query rows,
non-causally (it lies wholly before each holder's first new token). For one KV head the rows of a tile
are ``holder rows x G`` query heads, so a tile is a dense ``[BLOCK_M, D] x [D, BLOCK_N]`` product on the
tensor cores and the segment's KV is read once per M-tile instead of once per holder.

The launch walks a flat work list (``planning/shared_plan.py``: one item = segment, row range, KV token range,
first output slot) with the M-tile index varying fastest, so tiles that read the same KV chunk run
together and L2 absorbs the re-reads. Long segments with few rows are split along KV so every SM has
work; each item writes an fp32 partial (o, lse) per row into a slot, and ``merge.py`` combines a row's
slots. On a Hopper GPU, tall tiles over contiguous segments go to the Gluon kernel (``shared_gluon.py``).

When every segment of the step lies in consecutive cache blocks (how a prompt's blocks come out of a
fresh pool) and the GPU has a tensor-memory accelerator (Hopper), whole KV tiles are read with TMA
descriptor loads instead of per-token pointer gathers: fewer address registers and instructions in
the compute-bound loop (whole call at B=1024, P=16K, S=128: 0.945 -> 0.828 ms; docs/kernels.md §2.2).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from prefixserve.attention.kernels import shared_gluon, shared_gluon_fp8
from prefixserve.attention.kernels.attend import (
    accumulate_pv,
    attend_range,
    finish_rows,
    qk_scores,
    softmax_step,
    widened_kv,
    widened_q,
)
from prefixserve.attention.kernels.merge import csr_by_row, merge_partials
from prefixserve.attention.planning.shared_plan import WIDE_M, SharedWork, plan_shared_work
from prefixserve.attention.planning.tiles import (
    LOG2E,
    check_cache,
    dot_precision,
    interpreter_upcast,
    launch_fitting,
)
from prefixserve.triton_support import require_triton
from prefixserve.triton_support.launch import Launch

triton, tl = require_triton()


@triton.jit
def attend_rows_tma(
    q,
    m_i,
    l_i,
    acc,
    k_desc,  # TMA descriptor over the K cache as rows [num_blocks * block_size, kv_heads * HEAD_DIM]
    v_desc,
    row0,  # cache row of token kv_lo (the run is contiguous)
    kv_lo,
    kv_hi,  # whole BLOCK_N tiles only: no masks
    col,  # first column of this KV head
    qk_scale,
    BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """``attend_range(MASKED=False)`` over a contiguous run, each K / V tile one TMA load."""
    for start in range(kv_lo, kv_hi, BLOCK_N):
        row = row0 + (start - kv_lo)
        k = widened_kv(k_desc.load([row, col]), q.dtype)  # (fp8 caches take no TMA now)
        p, alpha, m_i, l_i = softmax_step(qk_scores(q, k, DOT_PREC, UPCAST), m_i, l_i, qk_scale)
        v = widened_kv(v_desc.load([row, col]), q.dtype)
        acc = accumulate_pv(acc, alpha, p, v, DOT_PREC, UPCAST)
    return m_i, l_i, acc


@triton.jit
def shared_program(
    item,
    kvh,
    q_ptr,  # [T, Hq, D]
    k_ptr,  # [num_blocks, block_size, Hkv, D]
    v_ptr,
    k_desc,  # TMA descriptors of k_ptr / v_ptr as rows (None unless USE_TMA)
    v_desc,
    seg_blocks_ptr,  # [total_segment_blocks] int32
    seg_block_start_ptr,  # [G+1] int32
    seg_rows_ptr,  # [R] int32: flat query row of each segment row
    items_ptr,  # [I, ITEM_FIELDS] int32
    o_ptr,  # [slots, Hq, D] fp32
    lse_ptr,  # [slots, Hq] fp32
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_op,
    stride_oh,
    stride_lp,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    USE_TMA: tl.constexpr,
    TAIL_STAGES: tl.constexpr,  # the ragged tail is under one tile: 1 = no pipeline buffers
):
    # a Triton kernel body: one work item's rows over its KV range, kept in one piece
    """One program of the shared kernel: work item ``item`` for KV head ``kvh`` -> partial slots."""
    base = items_ptr + item * 7  # ITEM_FIELDS
    seg = tl.load(base)
    row_lo = tl.load(base + 1)
    row_hi = tl.load(base + 2)
    kv_lo = tl.load(base + 3)
    kv_hi = tl.load(base + 4)
    slot0 = tl.load(base + 5)
    if row_lo < row_hi:  # else a padding item (fixed-capacity work lists)
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        r = row_lo + offs_m // GROUP
        head = kvh * GROUP + offs_m % GROUP
        row_ok = (offs_m < (BLOCK_M // GROUP) * GROUP) & (r < row_hi)
        tok = tl.load(seg_rows_ptr + r, mask=row_ok, other=0).to(tl.int64)
        q = tl.load(
            q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
            mask=row_ok[:, None],
            other=0.0,
        )
        q = widened_q(q, k_ptr)
        limit = tl.zeros([BLOCK_M], tl.int32) + kv_hi  # non-causal: every row sees the whole range
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        # whole BLOCK_N tiles without masks (every row sees every key of a segment), then the ragged tail
        kv_full = kv_lo + ((kv_hi - kv_lo) // BLOCK_N) * BLOCK_N
        table = seg_blocks_ptr + tl.load(seg_block_start_ptr + seg)
        if USE_TMA:
            m_i, l_i, acc = attend_rows_tma(
                q,
                m_i,
                l_i,
                acc,
                k_desc,
                v_desc,
                tl.load(base + 6),
                kv_lo,
                kv_full,
                kvh * HEAD_DIM,
                qk_scale,
                BLOCK_N,
                DOT_PREC,
                UPCAST,
            )
        else:
            m_i, l_i, acc = attend_range(
                q,
                m_i,
                l_i,
                acc,
                k_ptr + kvh * stride_kh,
                v_ptr + kvh * stride_vh,
                table,
                kv_lo,
                kv_full,
                limit,
                qk_scale,
                stride_kb,
                stride_kt,
                stride_vb,
                stride_vt,
                BLOCK_N,
                BLOCK_SIZE,
                HEAD_DIM,
                DOT_PREC,
                UPCAST,
                False,
            )
        m_i, l_i, acc = attend_range(
            q,
            m_i,
            l_i,
            acc,
            k_ptr + kvh * stride_kh,
            v_ptr + kvh * stride_vh,
            table,
            kv_full,
            kv_hi,
            limit,
            qk_scale,
            stride_kb,
            stride_kt,
            stride_vb,
            stride_vt,
            BLOCK_N,
            BLOCK_SIZE,
            HEAD_DIM,
            DOT_PREC,
            UPCAST,
            True,
            TAIL_STAGES,
        )
        o, lse = finish_rows(m_i, l_i, acc)
        slot = (slot0 + r - row_lo).to(tl.int64)
        tl.store(
            o_ptr + slot[:, None] * stride_op + head[:, None] * stride_oh + offs_d[None, :],
            o,
            mask=row_ok[:, None],
        )
        tl.store(lse_ptr + slot * stride_lp + head, lse, mask=row_ok)


@triton.jit
def _shared_kernel(
    q_ptr,  # [T, Hq, D]
    k_ptr,  # [num_blocks, block_size, Hkv, D]
    v_ptr,
    k_desc,  # TMA descriptors of k_ptr / v_ptr as rows (None unless USE_TMA)
    v_desc,
    seg_blocks_ptr,  # [total_segment_blocks] int32
    seg_block_start_ptr,  # [G+1] int32
    seg_rows_ptr,  # [R] int32: flat query row of each segment row
    items_ptr,  # [I, ITEM_FIELDS] int32
    o_ptr,  # [slots, Hq, D] fp32
    lse_ptr,  # [slots, Hq] fp32
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_op,
    stride_oh,
    stride_lp,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    USE_TMA: tl.constexpr,
    TAIL_STAGES: tl.constexpr = 1,  # the ragged tail is under one tile: no pipeline buffers
):
    """Grid (work items, KV heads); arguments as ``shared_program``'s."""
    shared_program(
        tl.program_id(0),
        tl.program_id(1),
        q_ptr,
        k_ptr,
        v_ptr,
        k_desc,
        v_desc,
        seg_blocks_ptr,
        seg_block_start_ptr,
        seg_rows_ptr,
        items_ptr,
        o_ptr,
        lse_ptr,
        qk_scale,
        stride_qt,
        stride_qh,
        stride_kb,
        stride_kt,
        stride_kh,
        stride_vb,
        stride_vt,
        stride_vh,
        stride_op,
        stride_oh,
        stride_lp,
        GROUP,
        BLOCK_M,
        BLOCK_N,
        HEAD_DIM,
        BLOCK_SIZE,
        DOT_PREC,
        UPCAST,
        USE_TMA,
        TAIL_STAGES,
    )


def kv_descriptor(cache: torch.Tensor, block_n: int) -> Any:
    """TMA descriptor of a [num_blocks, block_size, Hkv, D] cache as rows of Hkv x D; tiles [block_n, D]."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    num_blocks, block_size, kv_heads, dim = cache.shape
    return TensorDescriptor.from_tensor(cache.view(num_blocks * block_size, kv_heads * dim), [block_n, dim])


def _check_shared_args(
    lists: tuple[torch.Tensor, ...],  # (seg_blocks, seg_block_start, seg_rows)
    work: SharedWork,
    o_part: torch.Tensor,
    lse_part: torch.Tensor,
    heads: tuple[int, int],  # (Hq, D)
) -> None:
    """``launch_shared``'s checks of the segment lists and the partial buffers."""
    q_heads, dim = heads
    for name, t in zip(("seg_blocks", "seg_block_start", "seg_rows"), lists, strict=True):
        if t.dtype != torch.int32 or t.dim() != 1 or (t.numel() and t.stride(0) != 1):
            raise TypeError(f"{name} must be a contiguous 1-d int32 tensor")
    if o_part.dtype != torch.float32 or lse_part.dtype != torch.float32:
        raise TypeError("shared partials are fp32")
    if o_part.shape[0] < work.num_slots or o_part.shape[1:] != (q_heads, dim) or o_part.stride(2) != 1:
        raise ValueError(f"o_part {tuple(o_part.shape)} too small or wrong shape for {work.num_slots} slots")
    if lse_part.shape[0] < work.num_slots or lse_part.stride(1) != 1:
        raise ValueError("lse_part too small or not contiguous per head")


def launch_shared(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seg_blocks: torch.Tensor,
    seg_block_start: torch.Tensor,
    seg_rows: torch.Tensor,
    work: SharedWork,
    scale: float,
    o_part: torch.Tensor,  # [>= work.num_slots, Hq, D] fp32
    lse_part: torch.Tensor,  # [>= work.num_slots, Hq] fp32
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> Launch | None:
    """Run the shared-segment kernel over ``work``; writes partial slots of o_part / lse_part.

    Returns the recorded launch (None when there was no slot): args 0-2 are q, k_cache, v_cache
    (3-4 their TMA descriptors, remade from them on relaunch).
    """
    q_heads, kv_heads, dim, block_size = check_cache(q, k_cache, v_cache)
    _check_shared_args((seg_blocks, seg_block_start, seg_rows), work, o_part, lse_part, (q_heads, dim))
    if work.num_slots == 0:
        return None
    group = q_heads // kv_heads
    rest = (
        seg_blocks,
        seg_block_start,
        seg_rows,
        work.items,
        o_part,
        lse_part,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        o_part.stride(0),
        o_part.stride(1),
        lse_part.stride(0),
    )
    if work.tma and shared_gluon_fp8.taken(q, k_cache, v_cache, work.block_m):
        # an e4m3 cache, its products on FP8 tensor cores (docs/kernels.md §2.13)
        return shared_gluon_fp8.launch(q, k_cache, v_cache, seg_rows, work.items, o_part, lse_part, scale)
    if work.tma and shared_gluon.eligible(q, k_cache, v_cache, work.block_m, work.block_n):
        # Hopper, tall tiles: the warp-specialised Gluon kernel (1.2-1.4x this one alone;
        # docs/kernels.md §2.3)
        return shared_gluon.launch_shared_gluon(
            q,
            k_cache,
            v_cache,
            seg_rows,
            work.items,
            o_part,
            lse_part,
            scale,
            work.num_stages,
            work.block_m,
            # 128-row tiles keep the kernel's 128-token K/V tiles whatever the plan's block_n (items
            # are token ranges); 192-row ones take the plan's, fitted beside q's 256-row buffer
            work.block_n if work.block_m == WIDE_M else 128,
        )
    return launch_with_descriptors(
        _shared_kernel,
        (work.items.shape[0], kv_heads),
        (q, k_cache, v_cache),
        rest,
        work.tma,
        GROUP=group,
        BLOCK_M=work.block_m,
        BLOCK_N=work.block_n,
        HEAD_DIM=dim,
        BLOCK_SIZE=block_size,
        DOT_PREC=dot_precision(q.dtype),
        UPCAST=interpreter_upcast(q.dtype),
        num_warps=num_warps or (8 if work.block_m >= 128 else 4),
        num_stages=num_stages or work.num_stages,
    )


def launch_with_descriptors(
    kernel: Any,
    grid: tuple[int, ...],
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    rest: tuple[Any, ...],
    tma: bool,
    **kw: Any,
) -> Launch:
    """Launch a kernel whose arguments are (q, k_cache, v_cache, k_desc, v_desc, *rest).

    The descriptors (None off the TMA path) are made for the BLOCK_N being tried, and remade from a
    later layer's caches on relaunch (which swaps args 1 and 2).
    """
    _, k_cache, v_cache = qkv
    # an e4m3 cache takes the pointer loads (its TMA tiles are not tried yet)
    use_tma = tma and k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == qkv[0].dtype

    def args_for(tiles: dict[str, Any]) -> tuple[Any, ...]:
        descs = (kv_descriptor(k_cache, tiles["BLOCK_N"]), kv_descriptor(v_cache, tiles["BLOCK_N"]))
        return (*qkv, *(descs if use_tma else (None, None)), *rest)

    launch = launch_fitting(kernel, grid, args_for(kw), args_for if use_tma else None, USE_TMA=use_tma, **kw)
    if use_tma:
        block_n = launch.args[launch.num_positional + launch.keywords.index("BLOCK_N")]
        remake = lambda c: kv_descriptor(c, block_n)  # noqa: E731
        launch.derived = [(3, 1, remake), (4, 2, remake)]
    return launch


def segment_row_csr(work: SharedWork, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """CSR (row_ptr [R+1], part_idx) listing each segment row's split slots; host int32 tensors."""
    row_ptr, order = csr_by_row(work.slot_row_index.numpy(), num_rows)
    return torch.from_numpy(row_ptr.astype(np.int32)), torch.from_numpy(order.astype(np.int32))


def shared_segment_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    seg_blocks: torch.Tensor,  # [total_segment_blocks] int32
    seg_block_start: torch.Tensor,  # [G+1] int32
    seg_num_tokens: torch.Tensor,  # [G] int32
    seg_rows: torch.Tensor,  # [R] int32
    seg_row_start: torch.Tensor,  # [G+1] int32
    scale: float,
    *,
    target_programs: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    min_chunk: int = 256,
    use_tma: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row r of the result is query row seg_rows[r] attending all of its segment: (o [R,Hq,D] fp32, lse).

    ``use_tma=False`` forces the pointer-gather path even for contiguous segments (tests, benchmarks).
    """
    q_heads, kv_heads, dim, block_size = check_cache(q, k_cache, v_cache)
    num_rows = seg_rows.shape[0]
    work = plan_shared_work(
        seg_row_start.tolist(),
        seg_num_tokens.tolist(),
        kv_heads,
        q_heads // kv_heads,
        q.device,
        block_m=block_m,
        block_n=block_n,
        min_chunk=min_chunk,
        target_programs=target_programs,
        head_dim=dim,
        dtype=q.dtype,
        seg_blocks=seg_blocks.cpu().numpy() if use_tma else None,
        seg_block_start=seg_block_start.tolist(),
        block_size=block_size,
    )
    o_part = torch.empty(work.num_slots, q_heads, dim, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(work.num_slots, q_heads, dtype=torch.float32, device=q.device)
    launch_shared(q, k_cache, v_cache, seg_blocks, seg_block_start, seg_rows, work, scale, o_part, lse_part)
    if work.unsplit:
        return o_part, lse_part
    row_ptr, part_idx = segment_row_csr(work, num_rows)
    return merge_partials(
        o_part, lse_part, num_rows, row_ptr=row_ptr.to(q.device), part_idx=part_idx.to(q.device)
    )


def shared_segment_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seg_blocks: torch.Tensor,
    seg_block_start: torch.Tensor,
    seg_num_tokens: torch.Tensor,
    seg_rows: torch.Tensor,
    seg_row_start: torch.Tensor,
    scale: float,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of ``shared_segment_attention`` (one ``attention_with_lse`` per segment)."""
    from prefixserve.attention.reference import attention_with_lse

    num_rows = seg_rows.shape[0]
    q_heads, dim = q.shape[1:]
    out = torch.zeros(num_rows, q_heads, dim, dtype=compute_dtype, device=q.device)
    lse = torch.full((num_rows, q_heads), -math.inf, dtype=compute_dtype, device=q.device)
    bstart, rstart = seg_block_start.tolist(), seg_row_start.tolist()
    for g, n_tok in enumerate(seg_num_tokens.tolist()):
        blocks = seg_blocks[bstart[g] : bstart[g + 1]].long()
        k = k_cache.index_select(0, blocks).flatten(0, 1)[:n_tok]
        v = v_cache.index_select(0, blocks).flatten(0, 1)[:n_tok]
        rows = seg_rows[rstart[g] : rstart[g + 1]].long()
        o, l_ = attention_with_lse(q[rows], k, v, scale, None, compute_dtype)
        out[rstart[g] : rstart[g + 1]] = o
        lse[rstart[g] : rstart[g + 1]] = l_
    return out, lse


__all__ = ["launch_shared", "shared_segment_attention", "shared_segment_attention_ref"]
