"""A decode step's own part with the merge folded in: one kernel after the shared kernel.

The two-kernel path writes each row's own attention as an fp32 partial, then a third launch (the
CSR merge) reads every partial of a row back and writes the output. Here a program of (sequence,
KV head) first folds the row's shared partials (the shared kernel's, named by a CSR of shared slots
only) into an online-softmax state, then walks the sequence's own KV from that state, and writes the
finished rows in the output dtype: no own partial, no merge launch, one kernel boundary fewer.
Online softmax is associative, so seeding it with the merged shared parts is the same attention
(``merge.py``'s identity, with the own tokens as the last part).

Decode steps only (one query a sequence, row ``t`` is sequence ``t``), one own split, one program a
(KV head, ``pack`` sequences): one sequence walks its KV as the paged kernel does (``attend_range``),
several as the packed decode kernel does (``packed_range``). It must run after the shared kernel, on
the same stream.
"""

from __future__ import annotations

import torch

from prefixserve.attention.kernels.attend import attend_range, finish_rows
from prefixserve.attention.kernels.merge import fold_part
from prefixserve.attention.kernels.packed_decode import packed_range
from prefixserve.attention.kernels.tiles import (
    LOG2E,
    check_cache,
    dot_precision,
    fit_tiles,
    interpreter_upcast,
    launch_fitting,
    smem_limit,
)
from prefixserve.triton_support import require_triton
from prefixserve.triton_support.launch import Launch

triton, tl = require_triton()

# argument positions of (q, k_cache, v_cache, out), for ``step_launch.relaunch_layer``
OWN_MERGE = (0, 1, 2, 9)


@triton.jit(do_not_specialize=["num_rows", "stride_bt"])
def _own_merge_kernel(
    q_ptr,  # [T, Hq, D], row t = sequence t
    k_ptr,  # [num_blocks, block_size, Hkv, D]
    v_ptr,
    bt_ptr,  # [T, max_blocks] int32: own block tables
    own_lens_ptr,  # [T] int32: own KV tokens (0 for a padding row)
    o_part_ptr,  # [P, Hq, D] fp32: the shared kernel's partials
    lse_part_ptr,  # [P, Hq] fp32, natural log
    row_ptr_ptr,  # [T + 1] int32: row t's shared slots are part_idx[row_ptr[t]:row_ptr[t+1]]
    part_idx_ptr,  # [nnz] int32
    out_ptr,  # [T, Hq, D] q's dtype
    qk_scale,  # softmax scale * log2(e)
    num_rows,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_pp,
    stride_ph,
    stride_lp,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    PACK: tl.constexpr,  # decode rows a program (``packed_decode``'s packing)
    BLOCK_M: tl.constexpr,  # >= PACK x GROUP, >= 16
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Grid (row packs, KV heads): the GROUP query heads of one KV head for PACK decode rows."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row = tl.program_id(0) * PACK + offs_m // GROUP  # row m's sequence (decode: its query row)
    kvh = tl.program_id(1)
    head = kvh * GROUP + offs_m % GROUP
    row_ok = (offs_m < PACK * GROUP) & (row < num_rows)
    row64 = row.to(tl.int64)
    q = tl.load(
        q_ptr + row64[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )

    # the shared parts merged (natural-log max), as the CSR merge kernel folds them; packed rows
    # may have different counts: a row past its own count folds an empty part (weight 0)
    first = tl.load(row_ptr_ptr + row, mask=row_ok, other=0)
    count = tl.load(row_ptr_ptr + row + 1, mask=row_ok, other=0) - first
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    for i in range(0, tl.max(count, 0)):
        has = i < count
        slot = tl.load(part_idx_ptr + first + i, mask=has, other=0).to(tl.int64)
        lse = tl.load(lse_part_ptr + slot * stride_lp + head, mask=has, other=float("-inf"))
        o = tl.load(
            o_part_ptr + slot[:, None] * stride_pp + head[:, None] * stride_ph + offs_d[None, :],
            mask=has[:, None],
            other=0.0,
        )
        m, acc, denom = fold_part(m, acc, denom, lse, o)

    # ... are the online softmax's state in base 2: weights relative to m, their sum denom
    m_i = m * 1.4426950408889634
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh
    if PACK == 1:
        own_len = tl.load(own_lens_ptr + tl.program_id(0))
        limit = tl.zeros([BLOCK_M], tl.int32) + own_len  # one query, after every own token
        m_i, l_i, acc = attend_range(
            q,
            m_i,
            denom,
            acc,
            k_base,
            v_base,
            bt_ptr + tl.program_id(0).to(tl.int64) * stride_bt,
            0,
            own_len,
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
        )
    else:  # PACK rows' own KV in block-diagonal tiles, BLOCK_N // PACK tokens of each
        m_i, l_i, acc = packed_range(
            q,
            m_i,
            denom,
            acc,
            row,
            tl.program_id(0) * PACK,
            num_rows,
            0,
            1,
            0,
            own_lens_ptr,
            bt_ptr,
            k_base,
            v_base,
            qk_scale,
            stride_kb,
            stride_kt,
            stride_vb,
            stride_vt,
            stride_bt,
            PACK,
            BLOCK_N // PACK,
            HEAD_DIM,
            BLOCK_SIZE,
            DOT_PREC,
            UPCAST,
        )
    o, _lse = finish_rows(m_i, l_i, acc)
    tl.store(
        out_ptr + row64[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )


def launch_own_merge(
    q: torch.Tensor,  # [T, Hq, D], one decode query a row
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    own_tables: torch.Tensor,  # [T, max_blocks] int32
    own_lens: torch.Tensor,  # [T] int32
    o_part: torch.Tensor,  # [P, Hq, D] fp32 (the shared slots)
    lse_part: torch.Tensor,  # [P, Hq] fp32
    row_ptr: torch.Tensor,  # [T + 1] int32, shared slots only
    part_idx: torch.Tensor,  # [nnz] int32
    scale: float,
    out: torch.Tensor,  # [T, Hq, D], written
    block_n: int = 64,
    pack: int = 1,
    num_warps: int = 4,
    num_stages: int = 2,
) -> Launch | None:
    """Own attention of each decode row seeded with its merged shared partials, written to ``out``.

    Returns the recorded launch (args 0-2: q, k_cache, v_cache; 9: out), None for no rows.
    """
    q_heads, kv_heads, dim, block_size = check_cache(q, k_cache, v_cache)
    rows = q.shape[0]
    for name, t, dims in (("own_tables", own_tables, 2), ("own_lens", own_lens, 1), ("row_ptr", row_ptr, 1)):
        if t.dtype != torch.int32 or t.dim() != dims or t.stride(-1) != 1:
            raise TypeError(f"{name} must be a {dims}-d int32 tensor with a contiguous last dim")
    if own_lens.shape[0] != rows or own_tables.shape[0] != rows or row_ptr.numel() != rows + 1:
        raise ValueError(f"own_tables, own_lens and row_ptr must cover the {rows} decode rows")
    if o_part.dtype != torch.float32 or lse_part.dtype != torch.float32 or o_part.stride(2) != 1:
        raise TypeError("shared partials must be fp32 with a contiguous head_dim")
    if out.shape != q.shape or out.stride(2) != 1:
        raise ValueError(f"out {tuple(out.shape)} must be q's shape {tuple(q.shape)}, head_dim contiguous")
    if rows == 0:
        return None
    group = q_heads // kv_heads
    block_m = max(16, triton.next_power_of_2(pack * group))
    block_n = max(block_n, pack)
    block_m, block_n, num_stages = fit_tiles(
        block_m, block_n, num_stages, dim, q.element_size(), smem_limit(q.device)
    )
    args = (
        q,
        k_cache,
        v_cache,
        own_tables,
        own_lens,
        o_part,
        lse_part,
        row_ptr,
        part_idx,
        out,
        scale * LOG2E,
        rows,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        own_tables.stride(0),
        o_part.stride(0),
        o_part.stride(1),
        lse_part.stride(0),
        out.stride(0),
        out.stride(1),
    )
    return launch_fitting(
        _own_merge_kernel,
        (-(-rows // pack), kv_heads),
        args,
        GROUP=group,
        PACK=pack,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HEAD_DIM=dim,
        BLOCK_SIZE=block_size,
        DOT_PREC=dot_precision(q.dtype),
        UPCAST=interpreter_upcast(q.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
    )


__all__ = ["OWN_MERGE", "launch_own_merge"]
