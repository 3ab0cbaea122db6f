"""One Hopper kernel for a decode step's shared tiles and own KV, interleaved inside every program.

Why: the shared kernel (``shared_gluon.py``) holds an SM's whole shared memory and register file
while it runs, so the own kernel's KV streams only before or after it and a bytes-bound step costs
about shared + own (NOTES.md v7). Here each program walks one shared ticket (item, KV head) and an
even share of the own tickets (sequence, group of KV heads), and its loader warp puts both kinds of tile
through one TMA ring, evenly interleaved: while the consumers run a shared tile's products, the ring
already fetches the next own tile from HBM. Programs past the shared tickets stream own KV only.

An own ticket is (sequence, group of ``HT`` KV heads); its tiles are ``BLOCK_N / HT`` tokens of each
of the group's heads (``BLOCK_N`` rows), loaded one box per (cache block, head); blocks past the
sequence are out-of-bounds boxes, which TMA fills with zeros without reading memory. Consumer
warpgroup w takes the tile's rows of heads w HT/2 .. (w + 1) HT/2 - 1 and computes the transposed
product ``S^T = K Q^T`` against those heads' query heads (rows x padded query heads: wgmma's N can
be 8, its M cannot be under 64), masked block-diagonally (a row's key meets only its own head's
queries), the softmax along rows, and ``O^T += V^T P^T``, so a decode row's few heads cost little
tensor time. Each warpgroup owns whole heads, so at a ticket's end it writes their partials itself
(slot ``own_slot0 + row``), and the step's merge combines them with the shared slots as it does for
split KV. Tickets of several heads read a cache block's heads together and cost their per-ticket
work (query rows, partial stores) once per group.

To make room for the own operands (Q^T and P^T tiles), the shared tiles' query rows stay in
registers (wgmma's A from registers) instead of shared memory, and the consumers run tiles without
the intra-warpgroup overlap of the shared kernel.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from prefixserve.attention.kernels import shared_gluon
from prefixserve.attention.kernels.launch import Launch, record

if shared_gluon.GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from prefixserve.attention.kernels.shared_gluon import _item_range, _softmax_update, _store_rows

OWN_MAX_N = 16  # query heads per warpgroup's half of an own tile (padded to 8s: wgmma's N)
FORCE_HT = int(os.environ.get("PREFIXSERVE_MIXED_HT", "0"))  # KV heads per own tile; 0: ``own_tiling``
# "0": never; "1": every eligible decode step; "auto": ``use_mixed``'s rule (NOTES.md v8)
MODE = os.environ.get("PREFIXSERVE_MIXED", "auto")
GLUON_TFLOPS = 640.0  # the shared Gluon kernel's measured rate (NOTES.md v7)
COPY_TBPS = 4.0  # what the own KV streams at, about (H200)
MIN_OWN_SHARE = 0.5  # own time / shared time from which the mixed kernel pays
# own tokens per sequence (mean) from which it pays: each own ticket costs its warpgroups about 1 us
# beyond its tiles. One-tile tickets of one head (S=128, NOTES.md v8) lost at every point measured;
# tickets of four heads won there (v10); shorter own parts are not measured
MIN_OWN_TOKENS = 128

if shared_gluon.GLUON:

    @gluon.jit
    def _shared_ticket(items_ptr, t, num_items, kv_heads, BLOCK_N: gl.constexpr):
        """The program's shared ticket: ``_item_range``, with no tiles past the last ticket."""
        base, row_lo, row_hi, kv_len, n_tiles = _item_range(items_ptr, t, num_items, BLOCK_N)
        return base, row_lo, row_hi, kv_len, gl.where(t < num_items * kv_heads, n_tiles, 0)

    @gluon.jit
    def _own_len(own_lens_ptr, u, u_hi, groups):
        """Own KV tokens of own ticket u = (sequence, head group; ``groups`` per sequence); 0 past u_hi."""
        ok = u < u_hi
        return gl.where(ok, gl.load(own_lens_ptr + gl.where(ok, u // groups, 0)), 0)

    @gluon.jit
    def _own_tile_total(own_lens_ptr, u_lo, u_hi, groups, TILE_T: gl.constexpr):
        """Own tiles (``TILE_T`` tokens each) of tickets u_lo .. u_hi (a vector load per 32 x warps
        tickets: one memory trip)."""
        chunk: gl.constexpr = 32 * gl.num_warps()
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        total = 0
        for u0 in range(u_lo, u_hi, chunk):
            u = u0 + gl.arange(0, chunk, layout=layout)
            lens = gl.load(own_lens_ptr + u // groups, mask=u < u_hi, other=0)
            total += gl.sum((lens + TILE_T - 1) // TILE_T, 0)
        return total

    @gluon.jit
    def _tile_rows(walk_rows, u, j, kv_len, qi, BLOCK_SIZE: gl.constexpr):
        """Cache rows of own tile j of ticket u, one per block (``qi`` = 0 .. blocks per tile); a row
        past the cache's end for blocks past the sequence (TMA reads nothing and fills zeros)."""
        tables_ptr, table_stride, groups, oob_row = walk_rows
        b = j * qi.shape[0] + qi
        ok = b < gl.cdiv(kv_len, BLOCK_SIZE)
        blks = gl.load(tables_ptr + (u // groups).to(gl.int64) * table_stride + b, mask=ok, other=0)
        return gl.where(ok, blks * BLOCK_SIZE, oob_row)

    @gluon.jit
    def _is_shared(k, ns, total):
        """Step k of ``total`` is a shared tile: the ns shared steps spread evenly among the own ones."""
        return ((k + 1) * ns) // total > (k * ns) // total

    @gluon.jit
    def _mixed_load(
        k_desc,
        v_desc,
        ko_desc,
        vo_desc,
        k_bufs,
        v_bufs,
        k_ready,
        v_ready,
        kv_empty,
        walk,  # (items, num_items, kv_heads, t, own tables, own lengths, table stride, u_lo, u_hi, oob row)
        BLOCK_N: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        BLOCK_SIZE: gl.constexpr,
        STAGES: gl.constexpr,
        HT: gl.constexpr,
    ):
        """The loader warp: the program's shared and own tiles into the ring, in the consumers' order.

        An own tile's block ids are read (one vector load) before the wait for its slot, and the
        next ticket's length one ticket ahead, so memory latency does not stall the issue.
        """
        items_ptr, num_items, kv_heads, t, tables_ptr, own_lens_ptr, table_stride, u_lo, u_hi, oob_row = walk
        base, _lo, _hi, _len, ns = _shared_ticket(items_ptr, t, num_items, kv_heads, BLOCK_N)
        row0 = gl.load(base + 6)
        col_s = (t // num_items) * HEAD_DIM
        groups = kv_heads // HT
        TILE_T: gl.constexpr = BLOCK_N // HT  # tokens of each head in an own tile
        NB: gl.constexpr = TILE_T // BLOCK_SIZE
        total = ns + _own_tile_total(own_lens_ptr, u_lo, u_hi, groups, TILE_T)
        blk_layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        qi = gl.arange(0, NB, layout=blk_layout)
        u = u_lo
        j = 0
        kv_len = _own_len(own_lens_ptr, u, u_hi, groups)
        nxt_len = _own_len(own_lens_ptr, u + 1, u_hi, groups)
        walk_rows = (tables_ptr, table_stride, groups, oob_row)
        pf_rows = _tile_rows(walk_rows, u, 0, kv_len, qi, BLOCK_SIZE)  # the next own tile's, read ahead
        pf_u = u
        pf_j = 0
        for k in range(total):
            s = k % STAGES
            if _is_shared(k, ns, total):
                mbarrier.wait(kv_empty.index(s), ((k // STAGES) & 1) ^ 1)  # a fresh barrier passes phase 1
                row = row0 + ((k * ns) // total) * BLOCK_N
                mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(k_desc, [row, col_s], k_ready.index(s), k_bufs.index(s))
                mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(v_desc, [row, col_s], v_ready.index(s), v_bufs.index(s))
            else:
                while j * TILE_T >= kv_len:  # the next ticket with tiles (``total`` counted one)
                    u += 1
                    j = 0
                    kv_len = nxt_len
                    nxt_len = _own_len(own_lens_ptr, u + 1, u_hi, groups)
                rows = pf_rows
                if (pf_u != u) | (pf_j != j):  # an empty ticket in between: read this tile's now
                    rows = _tile_rows(walk_rows, u, j, kv_len, qi, BLOCK_SIZE)
                # read the rows of the tile after this one while this one's slot frees and loads
                if (j + 1) * TILE_T < kv_len:
                    pf_u = u
                    pf_j = j + 1
                    pf_rows = _tile_rows(walk_rows, u, j + 1, kv_len, qi, BLOCK_SIZE)
                else:
                    pf_u = u + 1
                    pf_j = 0
                    pf_rows = _tile_rows(walk_rows, u + 1, 0, nxt_len, qi, BLOCK_SIZE)
                col = (u % groups) * HT * HEAD_DIM
                mbarrier.wait(kv_empty.index(s), ((k // STAGES) & 1) ^ 1)
                mbarrier.expect(k_ready.index(s), NB * HT * ko_desc.block_type.nbytes)
                mbarrier.expect(v_ready.index(s), NB * HT * vo_desc.block_type.nbytes)
                for q in gl.static_range(NB):  # a block's heads together: one stretch of the cache row
                    row = gl.sum(gl.where(qi == q, rows, 0), 0)
                    for h in gl.static_range(HT):
                        dst = k_bufs.index(s).slice(h * TILE_T + q * BLOCK_SIZE, BLOCK_SIZE)
                        tma.async_copy_global_to_shared(
                            ko_desc, [row, col + h * HEAD_DIM], k_ready.index(s), dst
                        )
                        dst = v_bufs.index(s).slice(h * TILE_T + q * BLOCK_SIZE, BLOCK_SIZE)
                        tma.async_copy_global_to_shared(
                            vo_desc, [row, col + h * HEAD_DIM], v_ready.index(s), dst
                        )
                j += 1

    @gluon.jit
    def _own_query(
        q_ptr,
        u,
        u_hi,
        groups,
        w: gl.constexpr,
        stride_qt,
        stride_qh,
        GROUP: gl.constexpr,
        HT: gl.constexpr,
        ROWS: gl.constexpr,
        HEAD_DIM: gl.constexpr,
    ):
        """Load (into registers) warpgroup w's query heads of own ticket u's decode row (row =
        sequence; ``_own_heads``), rows past them zero; the consumers load a ticket ahead, so the
        latency is hidden."""
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [gl.num_warps(), 1], [1, 0])
        h = gl.arange(0, ROWS, layout=gl.SliceLayout(1, ld))
        d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, ld))
        ok = u < u_hi
        seq, head0 = _own_heads(gl.where(ok, u, 0), groups, w, GROUP, HT)
        offs = gl.expand_dims(seq.to(gl.int64) * stride_qt + (head0 + h) * stride_qh, 1)
        mask = gl.expand_dims((h < (HT // 2) * GROUP) & ok, 1)
        return gl.load(q_ptr + offs + gl.expand_dims(d, 0), mask=mask, other=0.0)

    @gluon.jit
    def _own_heads(u, groups, w: gl.constexpr, GROUP: gl.constexpr, HT: gl.constexpr):
        """Own ticket u's sequence and warpgroup w's first query head: the warpgroup takes KV heads
        w HT/2 .. of the ticket's group, so (HT / 2) x GROUP consecutive query heads."""
        return u // groups, ((u % groups) * HT + w * (HT // 2)) * GROUP

    @gluon.jit
    def _own_tile(
        qo_smem,
        pt_smem,
        k_half,  # [PART_M, D]: this warpgroup's tokens of the tile
        v_half,
        m_o,
        l_o,
        acc_o,  # [D, N] fp32: O^T
        tile,
        kv_len,
        qk_scale,
        TILE_T: gl.constexpr,
        GROUP: gl.constexpr,
    ):
        """S^T = K Q^T, the softmax along rows, O^T += V^T P^T for one own tile's half (its rows:
        TILE_T tokens of each of the warpgroup's heads; a row's key meets its own head's queries only)."""
        part_m: gl.constexpr = pt_smem.shape[0]
        own_n: gl.constexpr = pt_smem.shape[1]
        st_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, own_n, 16]
        )
        st = warpgroup_mma(
            k_half,
            qo_smem.permute((1, 0)),
            gl.zeros([part_m, own_n], gl.float32, layout=st_layout),
            use_acc=False,
            is_async=True,
        )
        st = warpgroup_mma_wait(0, deps=(st,))
        r = gl.arange(0, part_m, layout=gl.SliceLayout(1, st_layout))
        c = gl.arange(0, own_n, layout=gl.SliceLayout(0, st_layout))
        ok = gl.expand_dims(tile * TILE_T + r % TILE_T < kv_len, 1)
        st = gl.where(
            ok & (gl.expand_dims(r // TILE_T, 1) == gl.expand_dims(c // GROUP, 0)), st, float("-inf")
        )
        m_new = gl.maximum(m_o, gl.max(st, 0) * qk_scale)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet (or a padding column): p = 0
        alpha = gl.exp2(m_o - m_use)
        p = gl.exp2(st * qk_scale - gl.expand_dims(m_use, 0))
        l_o = l_o * alpha + gl.sum(p, 0)
        pt_smem.store(p.to(pt_smem.dtype))
        fence_async_shared()
        acc_o = acc_o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(0, acc_o.type.layout)), 0)
        acc_o = warpgroup_mma(v_half.permute((1, 0)), pt_smem, acc_o, is_async=True)
        acc_o = warpgroup_mma_wait(0, deps=(acc_o,))
        return m_new, l_o, acc_o

    @gluon.jit
    def _own_fresh(ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, layout: gl.constexpr):
        """An own ticket's running state before its first tile: (max, sum, O^T)."""
        m = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(0, layout))
        return (
            m,
            gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(0, layout)),
            gl.zeros([HEAD_DIM, ROWS], gl.float32, layout=layout),
        )

    @gluon.jit
    def _store_own(
        m_o,
        l_o,
        acc_o,
        o_ptr,
        lse_ptr,
        slot,
        head0,
        stride_op,
        stride_oh,
        stride_lp,
        HEADS: gl.constexpr,
    ):
        """o = O / l and the natural-log lse of query heads head0 .. head0 + HEADS into ``slot``."""
        dim: gl.constexpr = acc_o.shape[0]
        own_n: gl.constexpr = acc_o.shape[1]
        # O^T leaves the accumulator layout (a thread's values scattered over heads and d) for one in
        # which each thread holds 4 consecutive d of a head: whole 16-byte stores, coalesced per head
        ot_layout: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [1, gl.num_warps()], [0, 1])
        l_c = gl.convert_layout(l_o, gl.SliceLayout(0, ot_layout))
        l_safe = gl.where(l_c == 0.0, 1.0, l_c)
        o = gl.convert_layout(acc_o, ot_layout) / gl.expand_dims(l_safe, 0)
        h = gl.arange(0, own_n, layout=gl.SliceLayout(0, ot_layout))
        d = gl.arange(0, dim, layout=gl.SliceLayout(1, ot_layout))
        slot = slot.to(gl.int64)
        head = head0 + h
        ptrs = o_ptr + slot * stride_op + gl.expand_dims(head * stride_oh, 0) + gl.expand_dims(d, 1)
        gl.store(ptrs, o, mask=gl.expand_dims(h < HEADS, 0))
        m_c = gl.convert_layout(m_o, l_c.type.layout)
        lse = gl.where(l_c == 0.0, float("-inf"), (m_c + gl.log2(l_safe)) * 0.6931471805599453)
        gl.store(lse_ptr + slot * stride_lp + head, lse, mask=h < HEADS)

    @gluon.jit
    def _finish_own(w: gl.constexpr, m_o, l_o, acc_o, u, out, GROUP: gl.constexpr, HT: gl.constexpr):
        """End of own ticket u: warpgroup w's heads' partial into the sequence's own slot."""
        o_ptr, lse_ptr, groups, own_slot0, stride_op, stride_oh, stride_lp = out
        seq, head0 = _own_heads(u, groups, w, GROUP, HT)
        _store_own(
            m_o,
            l_o,
            acc_o,
            o_ptr,
            lse_ptr,
            own_slot0 + seq,
            head0,
            stride_op,
            stride_oh,
            stride_lp,
            (HT // 2) * GROUP,
        )

    @gluon.jit
    def _mixed_consumer(
        w: gl.constexpr,  # 0 or 1: this warpgroup's rows of a shared tile, its heads of an own tile
        bufs,  # (qo_smem, pt_smem, k_bufs, v_bufs, k_ready, v_ready, kv_empty)
        walk,  # as the loader's
        ptrs,  # (q, seg_rows, o, lse, qk_scale, own_slot0, strides...)
        GROUP: gl.constexpr,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        STAGES: gl.constexpr,
        HT: gl.constexpr,
    ):
        """One warpgroup: its 64 rows of each shared tile and its heads of each own tile, in ring order."""
        qo_all, pt_all, k_bufs, v_bufs, k_ready, v_ready, kv_empty = bufs
        items_ptr, num_items, kv_heads, t, _tables, own_lens_ptr, _ts, u_lo, u_hi, _oob = walk
        (
            q_ptr,
            seg_rows_ptr,
            o_ptr,
            lse_ptr,
            qk_scale,
            own_slot0,
            stride_qt,
            stride_qh,
            stride_op,
            stride_oh,
            stride_lp,
        ) = ptrs
        PART_M: gl.constexpr = BLOCK_M // 2
        m_off: gl.constexpr = w * PART_M
        qo_smem = qo_all.index(w)
        pt_smem = pt_all.index(w)
        num_warps: gl.constexpr = gl.num_warps()
        OWN_ROWS: gl.constexpr = qo_all.shape[1]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16]
        )
        ot_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, OWN_ROWS, 16]
        )
        q_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        dtype: gl.constexpr = k_bufs.dtype

        # the shared ticket's stacked query rows (holder rows x GROUP heads), kept in registers
        base, row_lo, row_hi, kv_len, ns = _shared_ticket(items_ptr, t, num_items, kv_heads, BLOCK_N)
        kvh_s = t // num_items
        tm = m_off + gl.arange(0, PART_M, layout=gl.SliceLayout(1, q_layout))
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, q_layout))
        r = row_lo + tm // GROUP
        row_ok = (tm < (BLOCK_M // GROUP) * GROUP) & (r < row_hi) & (ns > 0)
        tok = gl.load(seg_rows_ptr + r, mask=row_ok, other=0).to(gl.int64)
        q_offs = gl.expand_dims(tok * stride_qt + (kvh_s * GROUP + tm % GROUP) * stride_qh, 1)
        q = gl.load(q_ptr + q_offs + gl.expand_dims(offs_d, 0), mask=gl.expand_dims(row_ok, 1), other=0.0)

        groups = kv_heads // HT
        TILE_T: gl.constexpr = BLOCK_N // HT
        total = ns + _own_tile_total(own_lens_ptr, u_lo, u_hi, groups, TILE_T)
        m_s = gl.full([PART_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
        l_s = gl.zeros([PART_M], gl.float32, layout=gl.SliceLayout(1, s_layout))
        acc_s = gl.zeros([PART_M, HEAD_DIM], gl.float32, layout=o_layout)
        s_zero = gl.zeros([PART_M, BLOCK_N], gl.float32, layout=s_layout)
        # own ticket u's state; its successor's length and query rows are loaded a ticket ahead
        u = u_lo
        j = 0
        o_len = _own_len(own_lens_ptr, u, u_hi, groups)
        nxt_len = _own_len(own_lens_ptr, u + 1, u_hi, groups)
        qo_smem.store(
            _own_query(q_ptr, u, u_hi, groups, w, stride_qt, stride_qh, GROUP, HT, OWN_ROWS, HEAD_DIM)
        )
        fence_async_shared()  # generic stores before the wgmma's async reads
        nxt_q = _own_query(q_ptr, u + 1, u_hi, groups, w, stride_qt, stride_qh, GROUP, HT, OWN_ROWS, HEAD_DIM)
        m_o, l_o, acc_o = _own_fresh(OWN_ROWS, HEAD_DIM, ot_layout)
        out = (o_ptr, lse_ptr, groups, own_slot0, stride_op, stride_oh, stride_lp)
        for k in range(total):
            slot = k % STAGES
            phase = (k // STAGES) & 1
            if _is_shared(k, ns, total):
                mbarrier.wait(k_ready.index(slot), phase)
                sc = warpgroup_mma(
                    q, k_bufs.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True
                )
                sc = warpgroup_mma_wait(0, deps=(sc,))
                p, alpha, m_s, l_s = _softmax_update(
                    sc, m_s, l_s, (k * ns) // total, kv_len, qk_scale, BLOCK_N, s_layout
                )
                acc_s = acc_s * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
                p16 = gl.convert_layout(p.to(dtype), p_layout)
                mbarrier.wait(v_ready.index(slot), phase)
                acc_s = warpgroup_mma(p16, v_bufs.index(slot), acc_s, is_async=True)
                acc_s = warpgroup_mma_wait(0, deps=(acc_s,))
            else:
                while j * TILE_T >= o_len:  # ticket u is done: its partial out, the next one in
                    _finish_own(w, m_o, l_o, acc_o, u, out, GROUP, HT)
                    u += 1
                    j = 0
                    o_len = nxt_len
                    nxt_len = _own_len(own_lens_ptr, u + 1, u_hi, groups)
                    qo_smem.store(nxt_q)
                    fence_async_shared()
                    nxt_q = _own_query(
                        q_ptr, u + 1, u_hi, groups, w, stride_qt, stride_qh, GROUP, HT, OWN_ROWS, HEAD_DIM
                    )
                    m_o, l_o, acc_o = _own_fresh(OWN_ROWS, HEAD_DIM, ot_layout)
                mbarrier.wait(k_ready.index(slot), phase)
                mbarrier.wait(v_ready.index(slot), phase)
                m_o, l_o, acc_o = _own_tile(
                    qo_smem,
                    pt_smem,
                    k_bufs.index(slot).slice(m_off, PART_M),
                    v_bufs.index(slot).slice(m_off, PART_M),
                    m_o,
                    l_o,
                    acc_o,
                    j,
                    o_len,
                    qk_scale,
                    TILE_T,
                    GROUP,
                )
                j += 1
            mbarrier.arrive(kv_empty.index(slot), count=1)
        if ns > 0:
            _store_rows(
                m_s,
                l_s,
                acc_s,
                o_ptr,
                lse_ptr,
                row_lo,
                row_hi,
                gl.load(base + 5),
                kvh_s,
                m_off,
                stride_op,
                stride_oh,
                stride_lp,
                GROUP,
                BLOCK_M,
                PART_M,
                HEAD_DIM,
            )
        while u < u_hi:  # the last ticket with tiles, then any empty ones after it
            _finish_own(w, m_o, l_o, acc_o, u, out, GROUP, HT)
            u += 1
            m_o, l_o, acc_o = _own_fresh(OWN_ROWS, HEAD_DIM, ot_layout)

    @gluon.jit
    def mixed_gluon_kernel(
        q_ptr,  # [T, Hq, D]
        k_ptr,  # the K / V caches: unused, where the other kernels have them (recorded-launch swaps)
        v_ptr,
        k_desc,  # TMA descriptors over the caches as rows [num_blocks * block_size, Hkv * D]: shared
        v_desc,  # tiles [BLOCK_N, D]
        ko_desc,  # the same rows, boxes of one cache block [BLOCK_SIZE, D]: own tiles
        vo_desc,
        seg_rows_ptr,  # [R] int32: flat query row of each segment row
        items_ptr,  # [I, 7] int32 shared work list (TMA: field 6 = cache row of kv_lo)
        o_ptr,  # [slots, Hq, D] fp32
        lse_ptr,  # [slots, Hq] fp32
        own_tables_ptr,  # [num_seqs, width] int32: each sequence's own blocks
        own_lens_ptr,  # [num_seqs] int32: own KV tokens
        qk_scale,  # softmax scale x log2(e)
        num_items,
        kv_heads,
        num_seqs,
        table_stride,
        own_slot0,  # own partial of sequence s (decode row s): slot own_slot0 + s
        oob_row,  # a cache row past the end: TMA fills its box with zeros
        stride_qt,
        stride_qh,
        stride_op,
        stride_oh,
        stride_lp,
        GROUP: gl.constexpr,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        BLOCK_SIZE: gl.constexpr,
        STAGES: gl.constexpr,
        OWN_ROWS: gl.constexpr,
        HT: gl.constexpr,
    ):
        """1-d grid: program p takes shared ticket p (item fastest; none past the last) and own
        tickets [p n / G, (p + 1) n / G) of the n = sequences x KV head groups of HT heads."""
        p = gl.program_id(0)
        n_programs = gl.num_programs(0)
        n_own = num_seqs * (kv_heads // HT)
        u_lo = (p * n_own) // n_programs
        u_hi = ((p + 1) * n_own) // n_programs
        dtype: gl.constexpr = q_ptr.dtype.element_ty
        k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)  # noqa: RUF005
        v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)  # noqa: RUF005
        qo_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([OWN_ROWS, HEAD_DIM], dtype)
        qo_all = gl.allocate_shared_memory(dtype, [2, OWN_ROWS, HEAD_DIM], qo_layout)
        pt_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M // 2, OWN_ROWS], dtype)
        pt_all = gl.allocate_shared_memory(dtype, [2, BLOCK_M // 2, OWN_ROWS], pt_layout)
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=2)  # both consumers free the slot
        fence_async_shared()  # the barrier inits before any async use
        walk = (
            items_ptr,
            num_items,
            kv_heads,
            p,
            own_tables_ptr,
            own_lens_ptr,
            table_stride,
            u_lo,
            u_hi,
            oob_row,
        )
        bufs = (qo_all, pt_all, k_bufs, v_bufs, k_ready, v_ready, kv_empty)
        ptrs = (
            q_ptr,
            seg_rows_ptr,
            o_ptr,
            lse_ptr,
            qk_scale,
            own_slot0,
            stride_qt,
            stride_qh,
            stride_op,
            stride_oh,
            stride_lp,
        )
        gl.warp_specialize(
            [
                (_mixed_consumer, (0, bufs, walk, ptrs, GROUP, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, HT)),
                (_mixed_consumer, (1, bufs, walk, ptrs, GROUP, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, HT)),
                (
                    _mixed_load,
                    (
                        k_desc,
                        v_desc,
                        ko_desc,
                        vo_desc,
                        k_bufs,
                        v_bufs,
                        k_ready,
                        v_ready,
                        kv_empty,
                        walk,
                        BLOCK_N,
                        HEAD_DIM,
                        BLOCK_SIZE,
                        STAGES,
                        HT,
                    ),
                ),
            ],
            [4, 1],
            [240, 24],
        )


def own_descriptor(cache: torch.Tensor, block_n: int) -> Any:
    """TMA descriptor over a cache's rows with one cache block per box, in the ring's smem layout."""
    num_blocks, block_size, kv_heads, dim = cache.shape
    rows = cache.view(num_blocks * block_size, kv_heads * dim)
    layout = gl.NVMMASharedLayout.get_default_for([block_n, dim], shared_gluon._GL_DTYPES[cache.dtype])
    return TensorDescriptor.from_tensor(rows, [block_size, dim], layout)


def own_tiling(q_heads: int, kv_heads: int, block_size: int, block_n: int = 128) -> tuple[int, int]:
    """(KV heads per own tile, padded query heads per warpgroup's half), or (0, 0) where the mixed
    kernel cannot take the shape.

    Four heads where they divide the KV heads and a head's ``block_n / 4`` tokens are whole cache
    blocks (each warpgroup then owns two heads: 2 x GROUP query heads, which at GQA 4 fill wgmma's
    N = 8 with no padding), else two. ``PREFIXSERVE_MIXED_HT`` forces one (A/B runs)."""
    group = q_heads // kv_heads
    for ht in (FORCE_HT,) if FORCE_HT else (4, 2):
        rows = -(-(ht // 2) * group // 8) * 8
        if kv_heads % ht == 0 and (block_n // ht) % block_size == 0 and rows <= OWN_MAX_N:
            return ht, rows
    return 0, 0


def eligible(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_m: int, block_n: int
) -> bool:
    """True when the mixed kernel can run a decode step: the shared Gluon kernel's conditions and an
    own tiling (``own_tiling``)."""
    return shared_gluon.eligible(q, k_cache, v_cache, block_m, block_n) and bool(
        own_tiling(q.shape[1], k_cache.shape[2], k_cache.shape[1], block_n)[0]
    )


def launch_mixed(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seg_rows: torch.Tensor,
    items: torch.Tensor,
    own_tables: torch.Tensor,
    own_lens: torch.Tensor,
    o_part: torch.Tensor,
    lse_part: torch.Tensor,
    scale: float,
    own_slot0: int,
    programs: int,
    block_m: int = 128,
    block_n: int = 128,
    stages: int = 3,
) -> Launch:
    """Run ``mixed_gluon_kernel`` on ``programs`` programs (at least the shared tickets).

    Shared partials go where the work list's items say; own partials of sequence s (a decode step:
    query row s) to slot ``own_slot0 + s``. Returns the recorded
    launch, whose descriptors (args 3-6) are remade from a later layer's caches.
    """
    q_heads, dim = q.shape[1:]
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    heads_per_tile, own_rows = own_tiling(q_heads, kv_heads, block_size, block_n)
    args = (
        q,
        k_cache,
        v_cache,
        shared_gluon.gluon_descriptor(k_cache, block_n),
        shared_gluon.gluon_descriptor(v_cache, block_n),
        own_descriptor(k_cache, block_n),
        own_descriptor(v_cache, block_n),
        seg_rows,
        items,
        o_part,
        lse_part,
        own_tables,
        own_lens,
        scale * shared_gluon.LOG2E,
        items.shape[0],
        kv_heads,
        own_lens.shape[0],
        own_tables.stride(0),
        own_slot0,
        num_blocks * block_size,
        q.stride(0),
        q.stride(1),
        o_part.stride(0),
        o_part.stride(1),
        lse_part.stride(0),
    )
    kw = dict(
        GROUP=q_heads // kv_heads,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HEAD_DIM=dim,
        BLOCK_SIZE=block_size,
        STAGES=stages,
        OWN_ROWS=own_rows,
        HT=heads_per_tile,
        num_warps=4,  # the default partition: one consumer warpgroup
        maxnreg=shared_gluon.MAXNREG,
    )
    grid = (max(programs, items.shape[0] * kv_heads),)
    compiled = mixed_gluon_kernel[grid](*args, **kw)
    launch = record(mixed_gluon_kernel, grid, args, kw, compiled)
    shared = lambda c: shared_gluon.gluon_descriptor(c, block_n)  # noqa: E731
    own = lambda c: own_descriptor(c, block_n)  # noqa: E731
    launch.derived = [(3, 1, shared), (4, 2, shared), (5, 1, own), (6, 2, own)]
    return launch


def use_mixed(
    device: torch.device,
    dtype: torch.dtype,
    shape: tuple[int, int, int],
    work: Any,
    max_query_len: int,
    shared_row_tokens: int,
    own_tokens: int,
    num_seqs: int,
    mode: str | None = None,
    block_size: int = 16,
) -> bool:
    """True when a step runs as one mixed launch: a decode step on the shared Gluon kernel's path
    (TMA work list of 128 x 128 tiles; ``shape`` = (Hq, Hkv, D)) whose own KV (``own_tokens`` over
    ``num_seqs`` sequences, at least ``MIN_OWN_TOKENS`` each on average) takes long enough next to
    the shared products to be worth hiding under them; ``block_size`` = the cache's (``own_tiling``).
    ``mode`` (default ``MODE``): "0" never, "1" whenever eligible, "auto" the rule."""
    mode = MODE if mode is None else mode
    q_heads, kv_heads, dim = shape
    if (
        mode == "0"
        or max_query_len != 1
        or not own_tiling(q_heads, kv_heads, block_size)[0]
        or own_tokens == 0
    ):
        return False
    if not (work.tma and work.block_m == 128 and work.block_n == 128 and not work.programs):
        return False
    if not shared_gluon.eligible_for(device, dtype, dim):
        return False
    if mode == "1":
        return True
    if own_tokens < MIN_OWN_TOKENS * num_seqs:
        return False
    elt = torch.empty(0, dtype=dtype).element_size()
    own_ms = 2 * elt * kv_heads * dim * own_tokens / (COPY_TBPS * 1e9)
    shared_ms = 4 * q_heads * dim * shared_row_tokens / (GLUON_TFLOPS * 1e9)
    return own_ms >= MIN_OWN_SHARE * shared_ms
