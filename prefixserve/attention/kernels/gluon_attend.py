"""Gluon building blocks of the Hopper shared-tile pipeline (Triton's explicit-layout dialect), shared by
the shared-segment kernel (``shared_gluon.py``) and the mixed kernel (``mixed_gluon.py``).

A loader warp (``_load_partition``) walks a program's tickets (work item, KV head) and issues TMA loads
of each ticket's K and V tiles into a ring of shared-memory buffers; a consumer warpgroup takes a
ticket's query rows (``_ticket_query``), waits on the ring's mbarriers, runs the wgmma products and
the online softmax over the ticket's tiles (``_attend_tiles``) and stores its rows' partials
(``_store_rows``); ``_run_ticket`` is one ticket for one warpgroup. A ticket's tiles follow the
program's earlier tiles through the ring, so slots and phases carry from ticket to ticket.

Rows past a segment's end in its last tile are read (a TMA box is whole) and masked out of the
softmax; their V rows meet a zero probability, so the cache must hold finite values there: the
engine's cache is zero-initialised and only ever holds K/V projections.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

try:  # Gluon ships with Triton >= 3.5; the engine runs without it (pointer / tl kernels)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    GLUON = True
except ImportError:  # pragma: no cover - older Triton
    GLUON = False

LOG2E = 1.4426950408889634
GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16} if GLUON else {}
# what a cache may hold: q's dtype, or e4m3 (an FP8 KV cache, widened in shared memory: shared_gluon.py)
GL_CACHE_DTYPES = GL_DTYPES | {torch.float8_e4m3fn: gl.float8e4nv} if GLUON else {}


@functools.cache
def tile_layout(block_n: int, dim: int, dtype: torch.dtype) -> Any:
    """The shared-memory layout of a [block_n, dim] cache tile: the same object for every layer and
    step (working it out took about 10 us of host time a descriptor, two descriptors a launch)."""
    return gl.NVMMASharedLayout.get_default_for([block_n, dim], GL_CACHE_DTYPES[dtype])


def gluon_descriptor(cache: torch.Tensor, block_n: int) -> Any:
    """Gluon TMA descriptor of a [num_blocks, block_size, Hkv, D] cache as rows; tiles [block_n, D]."""
    num_blocks, block_size, kv_heads, dim = cache.shape
    rows = cache.view(num_blocks * block_size, kv_heads * dim)
    return TensorDescriptor.from_tensor(rows, [block_n, dim], tile_layout(block_n, dim, cache.dtype))


if GLUON:

    @gluon.jit
    def _item_range(items_ptr, t, num_items, BLOCK_N: gl.constexpr):
        """Ticket t = (item, KV head): the item's fields and its KV tile count (0 for a padding item)."""
        base = items_ptr + (t % num_items) * 7
        row_lo = gl.load(base + 1)
        row_hi = gl.load(base + 2)
        kv_len = gl.load(base + 4) - gl.load(base + 3)
        n_tiles = gl.where(row_lo < row_hi, gl.cdiv(kv_len, BLOCK_N), 0)
        return base, row_lo, row_hi, kv_len, n_tiles

    @gluon.jit
    def _load_partition(
        k_desc,
        v_desc,
        k_bufs,
        v_bufs,
        k_ready,
        v_ready,
        kv_empty,
        items_ptr,
        num_items,
        first,
        end,
        step,
        BLOCK_N: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        STAGES: gl.constexpr,
    ):
        """The loader warp: every ticket's K and V tiles into the ring, slot c % STAGES for the c-th
        tile of this program, once the consumers freed it."""
        c = 0
        for t in range(first, end, step):
            base, _lo, _hi, _len, n_tiles = _item_range(items_ptr, t, num_items, BLOCK_N)
            row0 = gl.load(base + 6)
            col = (t // num_items) * HEAD_DIM
            for i in range(n_tiles):
                s = c % STAGES
                mbarrier.wait(kv_empty.index(s), ((c // STAGES) & 1) ^ 1)  # a fresh barrier passes phase 1
                row = row0 + i * BLOCK_N
                mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(k_desc, [row, col], k_ready.index(s), k_bufs.index(s))
                mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(v_desc, [row, col], v_ready.index(s), v_bufs.index(s))
                c += 1

    @gluon.jit
    def _softmax_update(s, m_i, l_i, tile, kv_len, qk_scale, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
        """Online softmax of raw scores ``s`` of KV tile ``tile``: (p, alpha, new max, new sum)."""
        if (tile + 1) * BLOCK_N > kv_len:  # the ragged last tile: columns past the segment drop out
            cols = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            s = gl.where(gl.expand_dims(cols < kv_len, 0), s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
        return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)

    @gluon.jit
    def _attend_tiles(
        q_smem,
        k_bufs,
        v_bufs,
        k_ready,
        v_ready,
        kv_empty,
        c0,
        n_tiles,
        kv_len,
        qk_scale,
        PART_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        STAGES: gl.constexpr,
        OVERLAP: gl.constexpr,
    ):
        # a Gluon kernel body: one ticket's tile loop (wgmma, softmax, ring barriers), kept in one piece
        """S = Q K^T, online softmax, O += P V over one ticket's tiles for this partition's rows, the
        ticket's first tile being the program's c0-th through the ring: (m, l, O)."""
        num_warps: gl.constexpr = gl.num_warps()
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16]
        )
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        dtype: gl.constexpr = q_smem.dtype
        m_i = gl.full([PART_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([PART_M], gl.float32, layout=gl.SliceLayout(1, s_layout))
        acc = gl.zeros([PART_M, HEAD_DIM], gl.float32, layout=o_layout)
        s_zero = gl.zeros([PART_M, BLOCK_N], gl.float32, layout=s_layout)
        if OVERLAP:
            # P_{i-1} @ V_{i-1} runs on the tensor cores while the softmax of tile i runs (FA3's
            # intra-warpgroup overlap); the rescale of O waits for that product
            p16 = gl.zeros([PART_M, BLOCK_N], dtype, layout=p_layout)
            if n_tiles > 0:
                mbarrier.wait(k_ready.index(c0 % STAGES), (c0 // STAGES) & 1)
                s = warpgroup_mma(
                    q_smem, k_bufs.index(c0 % STAGES).permute((1, 0)), s_zero, use_acc=False, is_async=True
                )
                s = warpgroup_mma_wait(0, deps=(s,))
                p, alpha, m_i, l_i = _softmax_update(s, m_i, l_i, 0, kv_len, qk_scale, BLOCK_N, s_layout)
                p16 = gl.convert_layout(p.to(dtype), p_layout)
            for i in range(1, n_tiles):
                prev = (c0 + i - 1) % STAGES
                slot = (c0 + i) % STAGES
                mbarrier.wait(k_ready.index(slot), ((c0 + i) // STAGES) & 1)
                s_tok = warpgroup_mma(
                    q_smem, k_bufs.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True
                )
                mbarrier.wait(v_ready.index(prev), ((c0 + i - 1) // STAGES) & 1)
                acc_tok = warpgroup_mma(p16, v_bufs.index(prev), acc, is_async=True)
                s = warpgroup_mma_wait(1, deps=(s_tok,))
                p, alpha, m_i, l_i = _softmax_update(s, m_i, l_i, i, kv_len, qk_scale, BLOCK_N, s_layout)
                p16 = gl.convert_layout(p.to(dtype), p_layout)
                acc = warpgroup_mma_wait(0, deps=(acc_tok,))
                mbarrier.arrive(kv_empty.index(prev), count=1)
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
            if n_tiles > 0:
                last = c0 + n_tiles - 1
                mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
                acc = warpgroup_mma(p16, v_bufs.index(last % STAGES), acc, is_async=True)
                acc = warpgroup_mma_wait(0, deps=(acc,))
                mbarrier.arrive(kv_empty.index(last % STAGES), count=1)
        else:
            for i in range(n_tiles):
                slot = (c0 + i) % STAGES
                phase = ((c0 + i) // STAGES) & 1
                mbarrier.wait(k_ready.index(slot), phase)
                s = warpgroup_mma(
                    q_smem, k_bufs.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True
                )
                s = warpgroup_mma_wait(0, deps=(s,))
                p, alpha, m_i, l_i = _softmax_update(s, m_i, l_i, i, kv_len, qk_scale, BLOCK_N, s_layout)
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
                p16 = gl.convert_layout(p.to(dtype), p_layout)
                mbarrier.wait(v_ready.index(slot), phase)
                acc = warpgroup_mma(p16, v_bufs.index(slot), acc, is_async=True)
                acc = warpgroup_mma_wait(0, deps=(acc,))
                mbarrier.arrive(kv_empty.index(slot), count=1)
        return m_i, l_i, acc

    @gluon.jit
    def _store_rows(
        m_i,
        l_i,
        acc,
        o_ptr,
        lse_ptr,
        row_lo,
        row_hi,
        slot0,
        kvh,
        m_off,
        stride_op,
        stride_oh,
        stride_lp,
        GROUP: gl.constexpr,
        BLOCK_M: gl.constexpr,
        PART_M: gl.constexpr,
        HEAD_DIM: gl.constexpr,
    ):
        """o = O / l and the natural-log lse of tile rows m_off.. into the item's partial slots."""
        o_layout: gl.constexpr = acc.type.layout
        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
        l_safe = gl.where(l_o == 0.0, 1.0, l_o)
        o = acc / gl.expand_dims(l_safe, 1)
        t = m_off + gl.arange(0, PART_M, layout=gl.SliceLayout(1, o_layout))
        od = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        r = row_lo + t // GROUP
        ok = (t < (BLOCK_M // GROUP) * GROUP) & (r < row_hi)
        slot = (slot0 + r - row_lo).to(gl.int64)
        head = kvh * GROUP + t % GROUP
        gl.store(
            o_ptr + gl.expand_dims(slot * stride_op + head * stride_oh, 1) + gl.expand_dims(od, 0),
            o,
            mask=gl.expand_dims(ok, 1),
        )
        m_o = gl.convert_layout(m_i, l_o.type.layout)
        lse = gl.where(l_o == 0.0, float("-inf"), (m_o + gl.log2(l_safe)) * 0.6931471805599453)
        gl.store(lse_ptr + slot * stride_lp + head, lse, mask=ok)

    @gluon.jit
    def _pass_tiles(k_ready, v_ready, kv_empty, c0, n_tiles, STAGES: gl.constexpr):
        """Free each of a ticket's ring slots once its K and V have landed, as a consumer that used them
        would: the slot's count of consumers holds, and the loader refills it when the others are done."""
        for i in range(n_tiles):
            slot = (c0 + i) % STAGES
            phase = ((c0 + i) // STAGES) & 1
            mbarrier.wait(k_ready.index(slot), phase)
            mbarrier.wait(v_ready.index(slot), phase)
            mbarrier.arrive(kv_empty.index(slot), count=1)

    @gluon.jit
    def _run_ticket(
        q,  # the warpgroup's query rows: shared memory or registers (wgmma's A)
        ring,  # (K tiles, V tiles, k_ready, v_ready, kv_empty)
        c0,  # the ticket's first tile is the program's c0-th through the ring
        ticket,  # (item fields base, row_lo, row_hi, kv_len, tiles, KV head)
        out,  # (o, lse, strides of o's slots and heads, lse's slots)
        qk_scale,
        m_off,
        GROUP: gl.constexpr,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        OVERLAP: gl.constexpr,
    ):
        """One ticket for one warpgroup: its rows attend the ticket's tiles and land in its partial slots.
        A warpgroup whose rows all lie past the ticket's (a segment's last tile, short of the tile's
        height) only frees each slot once loaded: no products, no softmax, no stores."""
        k_bufs, v_bufs, k_ready, v_ready, kv_empty = ring
        base, row_lo, row_hi, kv_len, n_tiles, kvh = ticket
        o_ptr, lse_ptr, stride_op, stride_oh, stride_lp = out
        PART_M: gl.constexpr = 64  # a consumer warpgroup's query rows: one wgmma's M
        STAGES: gl.constexpr = k_bufs.shape[0]
        if (row_hi - row_lo) * GROUP <= m_off:
            _pass_tiles(k_ready, v_ready, kv_empty, c0, n_tiles, STAGES)
            return
        m_i, l_i, acc = _attend_tiles(
            q,
            k_bufs,
            v_bufs,
            k_ready,
            v_ready,
            kv_empty,
            c0,
            n_tiles,
            kv_len,
            qk_scale,
            PART_M,
            BLOCK_N,
            HEAD_DIM,
            STAGES,
            OVERLAP,
        )
        _store_rows(
            m_i,
            l_i,
            acc,
            o_ptr,
            lse_ptr,
            row_lo,
            row_hi,
            gl.load(base + 5),
            kvh,
            m_off,
            stride_op,
            stride_oh,
            stride_lp,
            GROUP,
            BLOCK_M,
            PART_M,
            HEAD_DIM,
        )

    @gluon.jit
    def _ticket_query(
        q_rows,  # (q, seg_rows, row_lo, row_hi, KV head, q strides): the ticket's rows
        m_off,
        GROUP: gl.constexpr,
        BLOCK_M: gl.constexpr,
        PART_M: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        layout: gl.constexpr,
    ):
        """A ticket's stacked query rows (holder rows x GROUP heads) m_off .. m_off + PART_M, in
        ``layout`` (rows past the ticket: zeros)."""
        q_ptr, seg_rows_ptr, row_lo, row_hi, kvh, stride_qt, stride_qh = q_rows
        tm = m_off + gl.arange(0, PART_M, layout=gl.SliceLayout(1, layout))
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
        r = row_lo + tm // GROUP
        row_ok = (tm < (BLOCK_M // GROUP) * GROUP) & (r < row_hi)
        tok = gl.load(seg_rows_ptr + r, mask=row_ok, other=0).to(gl.int64)
        head = kvh * GROUP + tm % GROUP
        q_offs = gl.expand_dims(tok * stride_qt + head * stride_qh, 1) + gl.expand_dims(offs_d, 0)
        return gl.load(q_ptr + q_offs, mask=gl.expand_dims(row_ok, 1), other=0.0)


__all__ = ["GLUON", "GL_DTYPES", "LOG2E", "gluon_descriptor", "tile_layout"]
