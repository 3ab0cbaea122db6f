"""One Hopper kernel for a decode step's shared tiles and own KV, run side by side in every program.

Why: the shared kernel (``shared_gluon.py``) holds an SM's whole shared memory and register file
while it runs, so the own kernel's KV streams only before or after it and a bytes-bound step costs
about shared + own (NOTES.md v7). Here one program per SM walks every SM-th shared ticket (item,
KV head) and an even share of the own tickets (sequence, group of KV heads) at the same time, with
separate roles:

- two shared warpgroups (64 query rows each) run the shared ticket's tiles (``_attend_tiles``, the
  shared kernel's loop), their query rows in registers, fed by a loader warp through a 3-deep ring
  of ``SHARED_N``-token tiles;
- one own warpgroup runs the own tiles, fed by a second loader warp through its own 3-deep ring.

Two rings, so that a shared tile held for its products never keeps the own tiles behind it out of
flight, and a warpgroup of its own for the own math, so that it never waits behind a shared tile
(NOTES.md v11; v8-v10 put both kinds of tile through one ring and the same two warpgroups).
Programs without a shared ticket stream own KV only.

An own ticket is (sequence, group of ``HT`` KV heads); its tiles are ``OWN_M / HT`` tokens of each
of the group's heads (``OWN_M`` = 64 rows: wgmma's M; 128 where own parts are short, ``own_rows_for``),
loaded one box per (cache block, head);
blocks past the sequence are out-of-bounds boxes, which TMA fills with zeros without reading
memory. The own warpgroup computes the transposed product ``S^T = K Q^T`` against the group's query
heads (rows x padded query heads: wgmma's N can be 8, its M cannot be under 64), masked
block-diagonally (a row's key meets only its own head's queries), the softmax along rows, and
``O^T += V^T P^T``, so a decode row's few heads cost little tensor time. At a ticket's end it writes
the group's partial (slot ``own_slot0 + row``), and the step's merge combines it with the shared
slots as it does for split KV.
"""

from __future__ import annotations

from typing import Any

import torch

from prefixserve import config
from prefixserve.attention.kernels import _ptxas, shared_gluon
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

    from prefixserve.attention.kernels.shared_gluon import (
        _item_range,
        _load_partition,
        _run_ticket,
        _ticket_query,
    )

OWN_MAX_N = 32  # query heads of an own tile (padded to 8s: wgmma's N)
# The ring shapes (NOTES.md v11): the shared ring holds 64-token tiles, so that with the own ring
# beside it (64-row tiles) both stay three deep in shared memory
SHARED_N = 64
SHARED_STAGES = 3
OWN_STAGES = 3
OWN_M = 64  # rows of an own tile: one warpgroup's wgmma M
# Own tiles of 128 rows (two wgmma M blocks) where own parts are short: half the own warpgroup's
# chains (products, row max, P^T store) per byte, for one shared ring slot less. Measured at B=1024
# (NOTES.md v19): GQA 4 -4 to -5% at S=128 (d 128), -4 to -9% at S=128-192 (d 64), level at S=192
# (d 128), +1-2% at S=512 (long tickets) and +11% at B=256, P=16K, S=512; GQA 3 and GQA 8 (d 128)
# +2 to +6% at S=128-192. So at SHORT_OWN_GROUP only, below SHORT_OWN_TOKENS own tokens a sequence
# (mean), and only where ptxas >= 12.9 builds the kernel (``_ptxas``).
SHORT_OWN_M = 128
SHORT_OWN_GROUP = 4
SHORT_OWN_TOKENS = 192
# registers a thread: the shared warpgroups and the own one; the loader warps' warpgroup keeps 24 and
# the default partition (a shared warpgroup) what is left: 2 x SHARED + OWN + 24 = 512
MAXNREG = 128  # 16 warps x 32 threads x 128 = 65,536 at launch
SHARED_REGS = 192
OWN_REGS = 512 - 2 * SHARED_REGS - 24
GLUON_TFLOPS = 640.0  # the shared Gluon kernel's measured rate (NOTES.md v7)
COPY_TBPS = 4.0  # what the own KV streams at, about (H200)
MIN_OWN_SHARE = 0.5  # own time / shared time from which the mixed kernel pays
# own tokens per sequence (mean) from which it pays: each own ticket costs about 1 us beyond its
# tiles. One-tile tickets of one head (S=128, NOTES.md v8) lost at every point measured; tickets of
# several heads won there (v10, v11); shorter own parts are not measured
MIN_OWN_TOKENS = 128

if shared_gluon.GLUON:
    # the mixed kernel's cubin by ptxas >= 12.9 where Triton has one: 12.8 miscompiles 128-row own tiles
    NEWER_PTXAS = _ptxas.build_with_newer("mixed_gluon_kernel")
    PTXAS_BUILD = _ptxas.newer_ptxas()[1] if NEWER_PTXAS else "bundled"
    _SHARED_REGS = gl.constexpr(SHARED_REGS)
    _OWN_REGS = gl.constexpr(OWN_REGS)

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
    def _own_load(
        ko_desc,
        vo_desc,
        ring,  # (K tiles, V tiles, ready, empty): the own ring
        walk,  # (own tables, own lengths, table stride, head groups, u_lo, u_hi, oob row)
        HEAD_DIM: gl.constexpr,
        BLOCK_SIZE: gl.constexpr,
        HT: gl.constexpr,
    ):
        """The own loader warp: the program's own tiles into the own ring, ticket after ticket.

        A tile's cache rows are read (one vector load) a tile ahead and a ticket's length a ticket
        ahead, so memory latency does not stall the issue."""
        k_bufs, v_bufs, ready, empty = ring
        tables_ptr, own_lens_ptr, table_stride, groups, u_lo, u_hi, oob_row = walk
        STAGES: gl.constexpr = k_bufs.shape[0]
        TILE_T: gl.constexpr = k_bufs.shape[1] // HT  # tokens of each head in an own tile
        NB: gl.constexpr = TILE_T // BLOCK_SIZE
        total = _own_tile_total(own_lens_ptr, u_lo, u_hi, groups, TILE_T)
        blk_layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        qi = gl.arange(0, NB, layout=blk_layout)
        walk_rows = (tables_ptr, table_stride, groups, oob_row)
        u = u_lo
        j = 0
        kv_len = _own_len(own_lens_ptr, u, u_hi, groups)
        nxt_len = _own_len(own_lens_ptr, u + 1, u_hi, groups)
        pf_rows = _tile_rows(walk_rows, u, 0, kv_len, qi, BLOCK_SIZE)  # the next tile's, read ahead
        pf_u = u
        pf_j = 0
        nbytes: gl.constexpr = NB * HT * (ko_desc.block_type.nbytes + vo_desc.block_type.nbytes)
        for k in range(total):
            s = k % STAGES
            while j * TILE_T >= kv_len:  # the next ticket with tiles (``total`` counted one)
                u += 1
                j = 0
                kv_len = nxt_len
                nxt_len = _own_len(own_lens_ptr, u + 1, u_hi, groups)
            rows = pf_rows
            if (pf_u != u) | (pf_j != j):  # an empty ticket in between: read this tile's now
                rows = _tile_rows(walk_rows, u, j, kv_len, qi, BLOCK_SIZE)
            if (j + 1) * TILE_T < kv_len:
                pf_u = u
                pf_j = j + 1
                pf_rows = _tile_rows(walk_rows, u, j + 1, kv_len, qi, BLOCK_SIZE)
            else:
                pf_u = u + 1
                pf_j = 0
                pf_rows = _tile_rows(walk_rows, u + 1, 0, nxt_len, qi, BLOCK_SIZE)
            col = (u % groups) * HT * HEAD_DIM
            mbarrier.wait(empty.index(s), ((k // STAGES) & 1) ^ 1)  # a fresh barrier passes phase 1
            mbarrier.expect(ready.index(s), nbytes)
            for q in gl.static_range(NB):  # a block's heads together: one stretch of the cache row
                row = gl.sum(gl.where(qi == q, rows, 0), 0)
                for h in gl.static_range(HT):
                    dst = k_bufs.index(s).slice(h * TILE_T + q * BLOCK_SIZE, BLOCK_SIZE)
                    tma.async_copy_global_to_shared(ko_desc, [row, col + h * HEAD_DIM], ready.index(s), dst)
                    dst = v_bufs.index(s).slice(h * TILE_T + q * BLOCK_SIZE, BLOCK_SIZE)
                    tma.async_copy_global_to_shared(vo_desc, [row, col + h * HEAD_DIM], ready.index(s), dst)
            j += 1

    @gluon.jit
    def _own_query(
        q_ptr,
        u,
        u_hi,
        groups,
        stride_qt,
        stride_qh,
        GROUP: gl.constexpr,
        HT: gl.constexpr,
        ROWS: gl.constexpr,
        HEAD_DIM: gl.constexpr,
    ):
        """Load (into registers) the HT x GROUP query heads of own ticket u's decode row (row =
        sequence), rows past them zero; the own warpgroup loads a ticket ahead, so the latency is
        hidden."""
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [gl.num_warps(), 1], [1, 0])
        h = gl.arange(0, ROWS, layout=gl.SliceLayout(1, ld))
        d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, ld))
        ok = u < u_hi
        uu = gl.where(ok, u, 0)
        head0 = (uu % groups) * HT * GROUP
        offs = gl.expand_dims((uu // groups).to(gl.int64) * stride_qt + (head0 + h) * stride_qh, 1)
        mask = gl.expand_dims((h < HT * GROUP) & ok, 1)
        return gl.load(q_ptr + offs + gl.expand_dims(d, 0), mask=mask, other=0.0)

    @gluon.jit
    def _own_tile(
        qo_smem,
        pt_smem,
        k_tile,  # [OWN_M, D]: TILE_T tokens of each of the ticket's heads
        v_tile,
        m_o,
        l_o,
        acc_o,  # [D, N] fp32: O^T
        tile,
        kv_len,
        qk_scale,
        TILE_T: gl.constexpr,
        GROUP: gl.constexpr,
    ):
        """S^T = K Q^T, the softmax along rows, O^T += V^T P^T for one own tile (its rows: TILE_T
        tokens of each of the ticket's heads; a row's key meets its own head's queries only)."""
        part_m: gl.constexpr = pt_smem.shape[0]
        own_n: gl.constexpr = pt_smem.shape[1]
        st_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, own_n, 16]
        )
        st = warpgroup_mma(
            k_tile,
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
        l_o = l_o * gl.expand_dims(alpha, 0) + p
        pt_smem.store(p.to(pt_smem.dtype))
        fence_async_shared()
        acc_o = acc_o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(0, acc_o.type.layout)), 0)
        acc_o = warpgroup_mma(v_tile.permute((1, 0)), pt_smem, acc_o, is_async=True)
        acc_o = warpgroup_mma_wait(0, deps=(acc_o,))
        return m_new, l_o, acc_o

    @gluon.jit
    def _own_fresh(OWN_M: gl.constexpr, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, layout: gl.constexpr):
        """An own ticket's running state before its first tile: (max, per-row sums, O^T). The sums
        stay one per tile row until the ticket's end (``_store_own``): a tile costs one reduction
        across the warpgroup's warps (the max), not two."""
        m = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(0, layout))
        return (
            m,
            gl.zeros([OWN_M, ROWS], gl.float32, layout=layout),
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
        """o = O / l and the natural-log lse of query heads head0 .. head0 + HEADS into ``slot`` (``l_o``:
        the sums of each tile row, added up here)."""
        dim: gl.constexpr = acc_o.shape[0]
        own_n: gl.constexpr = acc_o.shape[1]
        # O^T leaves the accumulator layout (a thread's values scattered over heads and d) for one in
        # which each thread holds 4 consecutive d of a head: whole 16-byte stores, coalesced per head
        ot_layout: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [1, gl.num_warps()], [0, 1])
        l_c = gl.convert_layout(gl.sum(l_o, 0), gl.SliceLayout(0, ot_layout))
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
    def _finish_own(m_o, l_o, acc_o, u, out, GROUP: gl.constexpr, HT: gl.constexpr):
        """End of own ticket u: its heads' partial into the sequence's own slot."""
        o_ptr, lse_ptr, groups, own_slot0, stride_op, stride_oh, stride_lp = out
        _store_own(
            m_o,
            l_o,
            acc_o,
            o_ptr,
            lse_ptr,
            own_slot0 + u // groups,
            (u % groups) * HT * GROUP,
            stride_op,
            stride_oh,
            stride_lp,
            HT * GROUP,
        )

    @gluon.jit
    def _own_consumer(
        ring,  # (K tiles, V tiles, ready, empty): the own ring
        own_smem,  # (Q^T rows, P^T) of the warpgroup's products
        walk,  # as the own loader's
        ptrs,  # (q, o, lse, qk_scale, own_slot0, strides...)
        GROUP: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        HT: gl.constexpr,
    ):
        """The own warpgroup: every own tile of the program's tickets, each ticket's partial at its end."""
        k_bufs, v_bufs, ready, empty = ring
        qo_smem, pt_smem = own_smem
        _tables, own_lens_ptr, _ts, groups, u_lo, u_hi, _oob = walk
        q_ptr, o_ptr, lse_ptr, qk_scale, own_slot0, stride_qt, stride_qh, stride_op, stride_oh, stride_lp = (
            ptrs
        )
        STAGES: gl.constexpr = k_bufs.shape[0]
        OWN_M: gl.constexpr = k_bufs.shape[1]
        TILE_T: gl.constexpr = OWN_M // HT
        OWN_ROWS: gl.constexpr = qo_smem.shape[0]
        ot_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, OWN_ROWS, 16]
        )
        total = _own_tile_total(own_lens_ptr, u_lo, u_hi, groups, TILE_T)
        # ticket u's state; its successor's length and query rows are loaded a ticket ahead
        u = u_lo
        j = 0
        o_len = _own_len(own_lens_ptr, u, u_hi, groups)
        nxt_len = _own_len(own_lens_ptr, u + 1, u_hi, groups)
        qo_smem.store(_own_query(q_ptr, u, u_hi, groups, stride_qt, stride_qh, GROUP, HT, OWN_ROWS, HEAD_DIM))
        fence_async_shared()  # generic stores before the wgmma's async reads
        nxt_q = _own_query(q_ptr, u + 1, u_hi, groups, stride_qt, stride_qh, GROUP, HT, OWN_ROWS, HEAD_DIM)
        m_o, l_o, acc_o = _own_fresh(OWN_M, OWN_ROWS, HEAD_DIM, ot_layout)
        out = (o_ptr, lse_ptr, groups, own_slot0, stride_op, stride_oh, stride_lp)
        for k in range(total):
            slot = k % STAGES
            while j * TILE_T >= o_len:  # ticket u is done: its partial out, the next one in
                _finish_own(m_o, l_o, acc_o, u, out, GROUP, HT)
                u += 1
                j = 0
                o_len = nxt_len
                nxt_len = _own_len(own_lens_ptr, u + 1, u_hi, groups)
                qo_smem.store(nxt_q)
                fence_async_shared()
                nxt_q = _own_query(
                    q_ptr, u + 1, u_hi, groups, stride_qt, stride_qh, GROUP, HT, OWN_ROWS, HEAD_DIM
                )
                m_o, l_o, acc_o = _own_fresh(OWN_M, OWN_ROWS, HEAD_DIM, ot_layout)
            mbarrier.wait(ready.index(slot), (k // STAGES) & 1)
            m_o, l_o, acc_o = _own_tile(
                qo_smem,
                pt_smem,
                k_bufs.index(slot),
                v_bufs.index(slot),
                m_o,
                l_o,
                acc_o,
                j,
                o_len,
                qk_scale,
                TILE_T,
                GROUP,
            )
            mbarrier.arrive(empty.index(slot), count=1)
            j += 1
        while u < u_hi:  # the last ticket with tiles, then any empty ones after it
            _finish_own(m_o, l_o, acc_o, u, out, GROUP, HT)
            u += 1
            m_o, l_o, acc_o = _own_fresh(OWN_M, OWN_ROWS, HEAD_DIM, ot_layout)

    @gluon.jit
    def _shared_consumer(
        m_off: gl.constexpr,  # this warpgroup's rows of the shared tiles: m_off .. m_off + BLOCK_M / 2
        ring,  # (K tiles, V tiles, k_ready, v_ready, empty): the shared ring
        walk,  # (items, num_items, kv_heads, first ticket, end, step)
        ptrs,  # (q, seg_rows, o, lse, qk_scale, strides...)
        GROUP: gl.constexpr,
        BLOCK_M: gl.constexpr,
        HEAD_DIM: gl.constexpr,
    ):
        """A shared warpgroup: its rows of the program's shared tickets, query rows kept in registers
        (wgmma's A), attended over each ticket's tiles and stored (``_run_ticket``; without the
        shared kernel's QK(j+1)-before-softmax(j) overlap: level to 1.6% slower here, docs/kernels.md)."""
        items_ptr, num_items, kv_heads, first, end, step = walk
        (
            q_ptr,
            seg_rows_ptr,
            o_ptr,
            lse_ptr,
            qk_scale,
            stride_qt,
            stride_qh,
            stride_op,
            stride_oh,
            stride_lp,
        ) = ptrs
        BLOCK_N: gl.constexpr = ring[0].shape[1]
        PART_M: gl.constexpr = BLOCK_M // 2
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, BLOCK_N, 16]
        )
        q_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
        c = 0  # the program's tiles through the ring so far
        for t in range(first, end, step):
            base, row_lo, row_hi, kv_len, ns = _shared_ticket(items_ptr, t, num_items, kv_heads, BLOCK_N)
            if ns > 0:
                kvh = t // num_items
                q_rows = (q_ptr, seg_rows_ptr, row_lo, row_hi, kvh, stride_qt, stride_qh)
                q = _ticket_query(q_rows, m_off, GROUP, BLOCK_M, PART_M, HEAD_DIM, q_layout)
                ticket = (base, row_lo, row_hi, kv_len, ns, kvh)
                out = (o_ptr, lse_ptr, stride_op, stride_oh, stride_lp)
                _run_ticket(
                    q, ring, c, ticket, out, qk_scale, m_off, GROUP, BLOCK_M, BLOCK_N, HEAD_DIM, False
                )
            c += ns

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
        OWN_STAGES: gl.constexpr,
        OWN_M: gl.constexpr,
        OWN_ROWS: gl.constexpr,
        HT: gl.constexpr,
        PTXAS: gl.constexpr,  # the ptxas that builds it (``_ptxas``): in the compile cache's key
    ):
        """1-d grid of G programs (one per SM): program p takes shared tickets p, p + G, ... (item
        fastest) and own tickets [p n / G, (p + 1) n / G) of the n = sequences x KV head groups of HT
        heads."""
        p = gl.program_id(0)
        n_programs = gl.num_programs(0)
        groups = kv_heads // HT
        n_own = num_seqs * groups
        u_lo = (p * n_own) // n_programs
        u_hi = ((p + 1) * n_own) // n_programs
        dtype: gl.constexpr = q_ptr.dtype.element_ty
        # the shared ring: [BLOCK_N, D] tiles of the shared ticket's segment
        k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)  # noqa: RUF005
        v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)  # noqa: RUF005
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        # the own ring: [OWN_M, D] tiles, TILE_T tokens of each of a ticket's HT heads
        own_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([OWN_M, HEAD_DIM], dtype)
        ko_bufs = gl.allocate_shared_memory(dtype, [OWN_STAGES, OWN_M, HEAD_DIM], own_layout)
        vo_bufs = gl.allocate_shared_memory(dtype, [OWN_STAGES, OWN_M, HEAD_DIM], own_layout)
        own_ready = gl.allocate_shared_memory(gl.int64, [OWN_STAGES, 1], mbarrier.MBarrierLayout())
        own_empty = gl.allocate_shared_memory(gl.int64, [OWN_STAGES, 1], mbarrier.MBarrierLayout())
        qo_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([OWN_ROWS, HEAD_DIM], dtype)
        qo_smem = gl.allocate_shared_memory(dtype, [OWN_ROWS, HEAD_DIM], qo_layout)
        pt_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([OWN_M, OWN_ROWS], dtype)
        pt_smem = gl.allocate_shared_memory(dtype, [OWN_M, OWN_ROWS], pt_layout)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=2)  # both shared warpgroups free the slot
        for i in gl.static_range(OWN_STAGES):
            mbarrier.init(own_ready.index(i), count=1)
            mbarrier.init(own_empty.index(i), count=1)
        fence_async_shared()  # the barrier inits before any async use
        shared_ring = (k_bufs, v_bufs, k_ready, v_ready, kv_empty)
        own_ring = (ko_bufs, vo_bufs, own_ready, own_empty)
        t_end = num_items * kv_heads
        t_step = n_programs
        shared_walk = (items_ptr, num_items, kv_heads, p, t_end, t_step)
        own_walk = (own_tables_ptr, own_lens_ptr, table_stride, groups, u_lo, u_hi, oob_row)
        strides = (stride_qt, stride_qh, stride_op, stride_oh, stride_lp)
        shared_ptrs = (q_ptr, seg_rows_ptr, o_ptr, lse_ptr, qk_scale) + strides  # noqa: RUF005
        own_ptrs = (q_ptr, o_ptr, lse_ptr, qk_scale, own_slot0) + strides  # noqa: RUF005
        gl.warp_specialize(
            [
                (_shared_consumer, (0, shared_ring, shared_walk, shared_ptrs, GROUP, BLOCK_M, HEAD_DIM)),
                (
                    _shared_consumer,
                    (BLOCK_M // 2, shared_ring, shared_walk, shared_ptrs, GROUP, BLOCK_M, HEAD_DIM),
                ),
                (_own_consumer, (own_ring, (qo_smem, pt_smem), own_walk, own_ptrs, GROUP, HEAD_DIM, HT)),
                (
                    _load_partition,
                    (
                        k_desc,
                        v_desc,
                        k_bufs,
                        v_bufs,
                        k_ready,
                        v_ready,
                        kv_empty,
                        items_ptr,
                        num_items,
                        p,
                        t_end,
                        t_step,
                        BLOCK_N,
                        HEAD_DIM,
                        STAGES,
                    ),
                ),
                (_own_load, (ko_desc, vo_desc, own_ring, own_walk, HEAD_DIM, BLOCK_SIZE, HT)),
            ],
            [4, 4, 1, 1],
            [_SHARED_REGS, _OWN_REGS, 24, 24],
        )


def own_descriptor(cache: torch.Tensor, block_n: int) -> Any:
    """TMA descriptor over a cache's rows with one cache block per box, in the ring's smem layout."""
    num_blocks, block_size, kv_heads, dim = cache.shape
    rows = cache.view(num_blocks * block_size, kv_heads * dim)
    layout = gl.NVMMASharedLayout.get_default_for([block_n, dim], shared_gluon._GL_DTYPES[cache.dtype])
    return TensorDescriptor.from_tensor(rows, [block_size, dim], layout)


def own_tiling(q_heads: int, kv_heads: int, block_size: int, own_m: int = OWN_M) -> tuple[int, int]:
    """(KV heads per own tile, padded query heads of an own tile: wgmma's N), or (0, 0) where the
    mixed kernel cannot take the shape.

    Two heads where they divide the KV heads and a head's ``OWN_M / 2`` tokens are whole cache blocks
    (2 x GROUP query heads: at GQA 4 wgmma's N = 8 with no padding, and the per-ticket work of query
    loads and partial stores shared by two heads), else one."""
    group = q_heads // kv_heads
    for ht in (2, 1):
        rows = -(-ht * group // 8) * 8
        if kv_heads % ht == 0 and (own_m // ht) % block_size == 0 and rows <= OWN_MAX_N:
            return ht, rows
    return 0, 0


def own_rows_for(own_tokens: int, num_seqs: int, group: int) -> int:
    """Rows of the own tiles of a mixed step with ``own_tokens`` own KV tokens over ``num_seqs``
    sequences and ``group`` query heads a KV head: ``SHORT_OWN_M`` where own parts are short (mean
    under ``SHORT_OWN_TOKENS``) at GQA ``SHORT_OWN_GROUP`` and ptxas >= 12.9 builds the kernel, else
    ``OWN_M``."""
    short = own_tokens < SHORT_OWN_TOKENS * max(num_seqs, 1) and group == SHORT_OWN_GROUP
    return SHORT_OWN_M if short and _ptxas.newer_ptxas() is not None else OWN_M


def ring_stages(own_m: int) -> tuple[int, int]:
    """(shared, own) ring slots: three of each with 64-row own tiles (32 KB + 32 KB a slot), two of
    each with 128-row ones (32 KB + 64 KB), in the 227 KB of an SM's shared memory."""
    return (SHARED_STAGES, OWN_STAGES) if own_m == OWN_M else (2, 2)


def eligible(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_m: int, block_n: int
) -> bool:
    """True when the mixed kernel can run a decode step: the shared Gluon kernel's conditions and an
    own tiling (``own_tiling``)."""
    return shared_gluon.eligible(q, k_cache, v_cache, block_m, block_n) and bool(
        own_tiling(q.shape[1], k_cache.shape[2], k_cache.shape[1])[0]
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
    own_m: int = OWN_M,
) -> Launch:
    """Run ``mixed_gluon_kernel`` on ``programs`` programs (one per SM), with own tiles of ``own_m``
    rows (``own_rows_for``).

    Shared partials go where the work list's items say; own partials of sequence s (a decode step:
    query row s) to slot ``own_slot0 + s``. Returns the recorded
    launch, whose descriptors (args 3-6) are remade from a later layer's caches.
    """
    if own_m != OWN_M and not NEWER_PTXAS:
        raise RuntimeError(f"{own_m}-row own tiles need ptxas >= 12.9 (12.8 miscompiles them; NOTES.md v19)")
    q_heads, dim = q.shape[1:]
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    heads_per_tile, own_rows = own_tiling(q_heads, kv_heads, block_size, own_m)
    shared_stages, own_stages = ring_stages(own_m)
    args = (
        q,
        k_cache,
        v_cache,
        shared_gluon.gluon_descriptor(k_cache, SHARED_N),
        shared_gluon.gluon_descriptor(v_cache, SHARED_N),
        own_descriptor(k_cache, own_m),
        own_descriptor(v_cache, own_m),
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
        BLOCK_N=SHARED_N,
        HEAD_DIM=dim,
        BLOCK_SIZE=block_size,
        STAGES=shared_stages,
        OWN_STAGES=own_stages,
        OWN_M=own_m,
        OWN_ROWS=own_rows,
        HT=heads_per_tile,
        PTXAS=PTXAS_BUILD,
        num_warps=4,  # the default partition: one shared warpgroup
        maxnreg=MAXNREG,
    )
    grid = (programs,)
    compiled = mixed_gluon_kernel[grid](*args, **kw)
    launch = record(mixed_gluon_kernel, grid, args, kw, compiled)
    shared = lambda c: shared_gluon.gluon_descriptor(c, SHARED_N)  # noqa: E731
    own = lambda c: own_descriptor(c, own_m)  # noqa: E731
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
    ``mode`` (default ``config.mixed_mode()``, PREFIXSERVE_MIXED): "0" never, "1" whenever eligible,
    "auto" the rule."""
    mode = config.mixed_mode() if mode is None else mode
    q_heads, kv_heads, dim = shape
    if (
        mode == "0"
        or max_query_len != 1
        or not own_tiling(q_heads, kv_heads, block_size)[0]
        or own_tokens == 0
    ):
        return False
    if not (work.tma and work.block_m == 128 and work.block_n == 128):
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


def mixed_rows(
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
) -> int:
    """Own tile rows of a step's mixed launch, or 0 where the step runs two kernels: ``use_mixed``
    (same arguments) decides the launch, ``own_rows_for`` its tile height."""
    step = (max_query_len, shared_row_tokens, own_tokens, num_seqs, mode)
    if not use_mixed(device, dtype, shape, work, *step, block_size=block_size):
        return 0
    return own_rows_for(own_tokens, num_seqs, shape[0] // shape[1])
