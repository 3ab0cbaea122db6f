"""Decode over several sequences per program (``packed_decode_program``): the paged kernel's variant for
decode steps whose GQA group fills few tensor-core rows.

One query per sequence fills only G rows of a tensor-core tile (padded to 16), so one sequence per
program leaves most rows empty and walks a short KV run with a pipeline that barely fills. Packing
PACK sequences makes the tile block-diagonal: each KV tile holds CHUNK tokens of every packed sequence,
the scores outside a row's own sequence are masked, and the loop is PACK times longer for the same MMA
work per token. ``launch_paged(pack=...)`` launches it; ``paged_attention_ref`` is its reference too.
"""

from __future__ import annotations

import math
from typing import Any

from prefixserve.attention.kernels.attend import (
    accumulate_pv,
    finish_rows,
    qk_scores,
    softmax_step,
    widened_kv,
    widened_q,
)
from prefixserve.attention.planning.tiles import (
    dot_precision,
    fit_tiles,
    interpreter_upcast,
    launch_fitting,
    smem_limit,
)
from prefixserve.triton_support import require_triton
from prefixserve.triton_support.launch import Launch

triton, tl = require_triton()


@triton.jit
def packed_decode_program(
    pid,  # group of PACK sequences
    kvh,
    split,
    num_splits,
    num_seqs,
    q_ptr,  # [T, Hq, D]
    k_ptr,  # [num_blocks, block_size, Hkv, D]
    v_ptr,
    bt_ptr,  # [S, max_blocks] int32
    seq_lens_ptr,  # [S] int32
    qsl_ptr,  # [S+1] int32: at most one query per sequence
    o_ptr,  # split 0 of [splits, T, Hq, D] (or the final [T, Hq, D] when there is one split)
    lse_ptr,  # split 0 of [splits, T, Hq]
    qk_scale,
    split_size,  # KV tokens per split; 0: each sequence's KV cut evenly into num_splits
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_os,
    stride_ot,
    stride_oh,
    stride_ls,
    stride_lt,
    GROUP: tl.constexpr,
    PACK: tl.constexpr,  # sequences per program
    BLOCK_M: tl.constexpr,  # >= PACK x GROUP, >= 16
    CHUNK: tl.constexpr,  # KV tokens of each sequence per tile: BLOCK_N = PACK x CHUNK
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # a Triton kernel body: one program's whole tile walk, kept in one piece
    """Decode over PACK sequences at once: row m is sequence m // GROUP, column n sequence n // CHUNK.

    One query per sequence fills only GROUP rows of a tensor-core tile (padded to 16), so one
    sequence per program leaves most rows empty and walks a short KV run (S=128: two 64-token
    tiles) with a pipeline that barely fills. Packing PACK sequences makes the tile block-diagonal:
    each KV tile holds CHUNK tokens of every packed sequence, the scores outside a row's own
    sequence are masked, and the loop is PACK times longer for the same MMA work per token.
    """
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, PACK * CHUNK)
    offs_d = tl.arange(0, HEAD_DIM)
    # rows: query heads of the packed sequences
    seq_m = pid * PACK + offs_m // GROUP
    head = kvh * GROUP + offs_m % GROUP
    live_m = (offs_m < PACK * GROUP) & (seq_m < num_seqs)
    q_start = tl.load(qsl_ptr + seq_m, mask=live_m, other=0)
    q_len = tl.load(qsl_ptr + seq_m + 1, mask=live_m, other=0) - q_start
    row_ok = live_m & (q_len > 0)
    tok = q_start.to(tl.int64)
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    q = widened_q(q, k_ptr)
    # columns: CHUNK-token slices of each packed sequence's KV split
    seq_n = pid * PACK + offs_n // CHUNK
    live_n = seq_n < num_seqs
    # (a sequence without a query still walks its KV, unseen: no row of the tile belongs to it)
    len_n = tl.load(seq_lens_ptr + seq_n, mask=live_n, other=0)
    even = tl.cdiv(tl.cdiv(len_n, num_splits), CHUNK) * CHUNK
    size_n = tl.where(split_size > 0, split_size, even)
    lo_n = split * size_n
    hi_n = tl.minimum(lo_n + size_n, len_n)
    steps = tl.max(tl.cdiv(tl.maximum(hi_n - lo_n, 0), CHUNK), 0)
    table_n = bt_ptr + seq_n.to(tl.int64) * stride_bt
    same = seq_m[:, None] == seq_n[None, :]
    k_base = k_ptr + kvh * stride_kh
    v_base = v_ptr + kvh * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for it in tl.range(0, steps):
        n = lo_n + it * CHUNK + offs_n % CHUNK
        n_ok = n < hi_n
        blk = tl.load(table_n + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        within = (n % BLOCK_SIZE).to(tl.int64)
        k_ptrs = k_base + blk[:, None] * stride_kb + within[:, None] * stride_kt + offs_d[None, :]
        k = widened_kv(tl.load(k_ptrs, mask=n_ok[:, None], other=0.0), q.dtype)
        s = qk_scores(q, k, DOT_PREC, UPCAST)
        s = tl.where(same & n_ok[None, :], s, float("-inf"))
        p, alpha, m_i, l_i = softmax_step(s, m_i, l_i, qk_scale)
        v_ptrs = v_base + blk[:, None] * stride_vb + within[:, None] * stride_vt + offs_d[None, :]
        v = widened_kv(tl.load(v_ptrs, mask=n_ok[:, None], other=0.0), q.dtype)
        acc = accumulate_pv(acc, alpha, p, v, DOT_PREC, UPCAST)
    o, lse = finish_rows(m_i, l_i, acc)
    split64 = split.to(tl.int64)
    o_rows = o_ptr + split64 * stride_os + tok[:, None] * stride_ot + head[:, None] * stride_oh
    tl.store(o_rows + offs_d[None, :], o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
    tl.store(lse_ptr + split64 * stride_ls + tok * stride_lt + head, lse, mask=row_ok)


@triton.jit(do_not_specialize=["num_seqs", "split_size", "stride_bt"])  # per-step values (compile_watch)
def _packed_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    seq_lens_ptr,
    qsl_ptr,
    o_ptr,
    lse_ptr,
    qk_scale,
    num_seqs,
    split_size,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_os,
    stride_ot,
    stride_oh,
    stride_ls,
    stride_lt,
    GROUP: tl.constexpr,
    PACK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Grid (sequence packs, KV heads, KV splits); arguments as ``packed_decode_program``'s."""
    packed_decode_program(
        tl.program_id(0),
        tl.program_id(1),
        tl.program_id(2),
        tl.num_programs(2),
        num_seqs,
        q_ptr,
        k_ptr,
        v_ptr,
        bt_ptr,
        seq_lens_ptr,
        qsl_ptr,
        o_ptr,
        lse_ptr,
        qk_scale,
        split_size,
        stride_qt,
        stride_qh,
        stride_kb,
        stride_kt,
        stride_kh,
        stride_vb,
        stride_vt,
        stride_vh,
        stride_bt,
        stride_os,
        stride_ot,
        stride_oh,
        stride_ls,
        stride_lt,
        GROUP,
        PACK,
        BLOCK_M,
        CHUNK,
        HEAD_DIM,
        BLOCK_SIZE,
        DOT_PREC,
        UPCAST,
    )


def decode_pack(group: int, max_query_len: int) -> int:
    """Sequences per program for a decode step: enough to fill 16 tensor-core rows with GQA groups.

    A power of two (tile widths are), 1 for prefill rows or groups of more than 8 heads. Measured at
    G=4 (H200, docs/kernels.md §2.1): 4 per program is 7% faster at B=256, S=512 and even at B=1024.
    """
    if max_query_len != 1 or group > 8:
        return 1
    return 1 << ((16 // group).bit_length() - 1)


def launch_packed_decode(
    tensors: tuple[Any, ...],  # (q, k_cache, v_cache, tables, seq_lens, query_start_loc, o, lse, qk_scale)
    strides: tuple[int, ...],  # as ``launch_paged`` passes them
    num_splits: int,
    split_size: int,
    pack: int,
    block_n: int,
    num_warps: int | None,
    stages: int,
) -> Launch:
    """Launch ``_packed_decode_kernel`` for a decode step, ``pack`` sequences per program, each
    contributing ``block_n // pack`` tokens to a KV tile (``launch_paged`` checked the arguments)."""
    q, k_cache = tensors[0], tensors[1]
    q_heads, dim = q.shape[1:]
    _, block_size, kv_heads, _ = k_cache.shape
    group = q_heads // kv_heads
    num_seqs = tensors[4].shape[0]
    chunk = max(1, block_n // pack)
    block_m = max(16, triton.next_power_of_2(pack * group))
    block_m, _, stages = fit_tiles(block_m, pack * chunk, stages, dim, q.element_size(), smem_limit(q.device))
    return launch_fitting(
        _packed_decode_kernel,
        (math.ceil(num_seqs / pack), kv_heads, num_splits),
        (*tensors, num_seqs, split_size, *strides),
        GROUP=group,
        PACK=pack,
        BLOCK_M=block_m,
        CHUNK=chunk,
        HEAD_DIM=dim,
        BLOCK_SIZE=block_size,
        DOT_PREC=dot_precision(q.dtype),
        UPCAST=interpreter_upcast(q.dtype),
        num_warps=num_warps or 4,
        num_stages=stages,
    )


__all__ = ["decode_pack", "launch_packed_decode"]
