"""The mixed kernel's own tiles (``mixed_gluon.py``): a decode step's own KV, read by the own loader warp
and attended by the own warpgroup, beside the shared tiles.

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

from prefixserve.attention.kernels.gluon_attend import GLUON

if GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )


if GLUON:

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
