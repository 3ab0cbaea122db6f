"""The shared-segment kernel's products on FP8 tensor cores, over an e4m3 KV cache (Hopper, Gluon).

``shared_gluon``'s e4m3 form widens every K and V tile to q's dtype and runs bf16 wgmmas, so the
compute-bound shared segment costs what it costs over a bf16 cache, plus the widening. Here both
products run on e4m3 operands at twice the bf16 tensor-core rate (FA3's FP8 forward):

- Q K^T: each consumer warpgroup quantizes its 64 query rows to e4m3, one scale a row (row amax /
  448; q arrives rotated and times K's scale, ``kv_quant``), and multiplies the scores back by the
  row's scale inside the softmax. K tiles are read as they landed.
- P V: the probabilities, in [0, 1], go to e4m3 times ``P_SCALE`` (so that those down to about
  2^-15 stay normal numbers rather than e4m3's coarse subnormals; folded into the exponent), and the
  row sums are of the unrounded P, so O / l cancels the scale. FP8 wgmma reads its B operand K-major
  only, and a V tile lands token by dimension, so a transposing warpgroup (``_transpose_partition``)
  turns each V tile into a second ring, [D, tokens], that the P V products read.

The loader warp, tickets, query gathering and row stores are ``gluon_attend``'s. One tile height:
128 rows (two consumer warpgroups, each with the in-warpgroup overlap). Its error against fp64 is
e4m3's rounding of q and P (tests/kernels/test_shared_fp8mma.py), which on the default model stays
within issue 103's accuracy bounds (docs/kernels.md §2.13). The engine takes it only when switched
on (``products``): its run inside the engine's graphs is still to be checked on a GPU. q as two e4m3
terms (the second the first's residual, which the default model does not notice at all) returned
wrong rows when its two products were chained into one accumulator, and is not built.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from prefixserve.attention.kernels import shared_gluon
from prefixserve.attention.kernels.gluon_attend import GLUON
from prefixserve.triton_support.launch import Launch

if GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from prefixserve.attention.kernels.gluon_attend import (
        _item_range,
        _load_partition,
        _store_rows,
        _ticket_query,
    )

P_SCALE = 448.0  # P in [0, 1] times this before its e4m3 rounding

if GLUON:
    LOG2_P_SCALE = gl.constexpr(math.log2(P_SCALE))

    @gluon.jit
    def _quantized_rows(q, s_layout: gl.constexpr):
        """Query rows ``q`` [PART_M, D] in e4m3 over their row scales (amax / 448; 1 for a zero row),
        and those scales in the score rows' layout."""
        qf = q.to(gl.float32)
        amax = gl.max(gl.abs(qf), 1)
        scale = gl.where(amax > 0.0, amax / 448.0, 1.0)
        q8 = (qf / gl.expand_dims(scale, 1)).to(gl.float8e4nv)
        return q8, gl.convert_layout(scale, gl.SliceLayout(1, s_layout))

    @gluon.jit
    def _softmax_rows(s, m_i, l_i, tile, kv_len, row_scale, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
        """``gluon_attend._softmax_update`` with a scale a row (softmax scale x log2 e x q's row scale,
        positive, so a row's max commutes with it), p times ``P_SCALE`` (in the exponent: free) and
        the sum of those: (p x P_SCALE, alpha, new max, new sum x P_SCALE)."""
        if (tile + 1) * BLOCK_N > kv_len:
            cols = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            s = gl.where(gl.expand_dims(cols < kv_len, 0), s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1) * row_scale)
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s * gl.expand_dims(row_scale, 1) - gl.expand_dims(m_new - LOG2_P_SCALE, 1))
        return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)

    @gluon.jit
    def _attend_fp8(
        q8,  # the rows in e4m3, in shared memory
        ring,  # (K tiles, V tiles, k_ready, v_ready, kv_empty): the loader's, K read from it
        vt_ring,  # (V^T tiles, vt_ready, vt_empty): the transposer's
        ticket,  # (its first tile's count through the ring, tiles, KV tokens, score scale a row)
        PART_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        HEAD_DIM: gl.constexpr,
    ):
        # a Gluon kernel body: one ticket's tile loop (wgmma, softmax, ring barriers), kept in one piece
        """S = Q8 K8^T, online softmax, O += P8 V8 over one ticket's tiles, P V of tile i-1 on the
        tensor cores while tile i's softmax runs: (m, l x P_SCALE, O x P_SCALE)."""
        k_bufs, _v, k_ready, _vr, kv_empty = ring
        vt_bufs, vt_ready, vt_empty = vt_ring
        c0, n_tiles, kv_len, row_scale = ticket
        STAGES: gl.constexpr = k_bufs.shape[0]
        VT: gl.constexpr = vt_bufs.shape[0]
        num_warps: gl.constexpr = gl.num_warps()
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 32]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 32]
        )
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
        m_i = gl.full([PART_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([PART_M], gl.float32, layout=gl.SliceLayout(1, s_layout))
        acc = gl.zeros([PART_M, HEAD_DIM], gl.float32, layout=o_layout)
        s_zero = gl.zeros([PART_M, BLOCK_N], gl.float32, layout=s_layout)
        p8 = gl.zeros([PART_M, BLOCK_N], gl.float8e4nv, layout=p_layout)
        if n_tiles > 0:
            mbarrier.wait(k_ready.index(c0 % STAGES), (c0 // STAGES) & 1)
            k_t = k_bufs.index(c0 % STAGES).permute((1, 0))
            s = warpgroup_mma(q8, k_t, s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(0, deps=(s,))
            mbarrier.arrive(kv_empty.index(c0 % STAGES), count=1)  # K read; V is the transposer's
            p, alpha, m_i, l_i = _softmax_rows(s, m_i, l_i, 0, kv_len, row_scale, BLOCK_N, s_layout)
            p8 = gl.convert_layout(p.to(gl.float8e4nv), p_layout)
        for i in range(1, n_tiles):
            c = c0 + i
            slot = c % STAGES
            prev = (c - 1) % VT
            mbarrier.wait(k_ready.index(slot), (c // STAGES) & 1)
            k_t = k_bufs.index(slot).permute((1, 0))
            s_tok = warpgroup_mma(q8, k_t, s_zero, use_acc=False, is_async=True)
            mbarrier.wait(vt_ready.index(prev), ((c - 1) // VT) & 1)
            acc_tok = warpgroup_mma(p8, vt_bufs.index(prev).permute((1, 0)), acc, is_async=True)
            s = warpgroup_mma_wait(1, deps=(s_tok,))
            mbarrier.arrive(kv_empty.index(slot), count=1)
            p, alpha, m_i, l_i = _softmax_rows(s, m_i, l_i, i, kv_len, row_scale, BLOCK_N, s_layout)
            p8 = gl.convert_layout(p.to(gl.float8e4nv), p_layout)
            acc = warpgroup_mma_wait(0, deps=(acc_tok,))
            mbarrier.arrive(vt_empty.index(prev), count=1)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        if n_tiles > 0:
            last = c0 + n_tiles - 1
            mbarrier.wait(vt_ready.index(last % VT), (last // VT) & 1)
            acc = warpgroup_mma(p8, vt_bufs.index(last % VT).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(vt_empty.index(last % VT), count=1)
        return m_i, l_i, acc

    @gluon.jit
    def _pass_fp8(ring, vt_ring, c0, n_tiles):
        """An idle consumer's share of a ticket's slots (its rows lie past the ticket's): each K read
        and each V^T tile used, as a working consumer would free them."""
        _k, _v, k_ready, _vr, kv_empty = ring
        _vt, vt_ready, vt_empty = vt_ring
        STAGES: gl.constexpr = _k.shape[0]
        VT: gl.constexpr = _vt.shape[0]
        for i in range(n_tiles):
            c = c0 + i
            mbarrier.wait(k_ready.index(c % STAGES), (c // STAGES) & 1)
            mbarrier.arrive(kv_empty.index(c % STAGES), count=1)
            mbarrier.wait(vt_ready.index(c % VT), (c // VT) & 1)
            mbarrier.arrive(vt_empty.index(c % VT), count=1)

    @gluon.jit
    def _consumer_fp8(
        m_off,
        shared,  # (q's e4m3 rows, ring, vt_ring, pointers, the ticket walk, strides): see the kernel
        GROUP: gl.constexpr,
        BLOCK_M: gl.constexpr,
        PART_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        HEAD_DIM: gl.constexpr,
    ):
        """One warpgroup's rows m_off .. m_off + PART_M of every ticket: gathered, quantized, attended,
        stored."""
        (
            q8_rows,
            ring,
            vt_ring,
            q_ptr,
            seg_rows_ptr,
            items_ptr,
            o_ptr,
            lse_ptr,
            qk_scale,
            num_items,
            first,
            end,
            step,
            stride_qt,
            stride_qh,
            stride_op,
            stride_oh,
            stride_lp,
        ) = shared
        num_warps: gl.constexpr = gl.num_warps()
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 32]
        )
        q8 = q8_rows.slice(m_off, PART_M)
        c = 0
        for t in range(first, end, step):
            base, row_lo, row_hi, kv_len, n_tiles = _item_range(items_ptr, t, num_items, BLOCK_N)
            kvh = t // num_items
            if (row_hi - row_lo) * GROUP <= m_off:
                _pass_fp8(ring, vt_ring, c, n_tiles)
            else:
                q_rows = (q_ptr, seg_rows_ptr, row_lo, row_hi, kvh, stride_qt, stride_qh)
                q = _ticket_query(q_rows, m_off, GROUP, BLOCK_M, PART_M, HEAD_DIM, ld)
                rows, row_scale = _quantized_rows(q, s_layout)
                q8.store(rows)
                fence_async_shared()  # generic stores before the wgmma's async reads
                row_scale = row_scale * qk_scale
                ticket = (c, n_tiles, kv_len, row_scale)
                m_i, l_i, acc = _attend_fp8(q8, ring, vt_ring, ticket, PART_M, BLOCK_N, HEAD_DIM)
                _store_rows(  # O / l cancels P_SCALE; the lse takes it off its max
                    m_i - LOG2_P_SCALE,
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
            c += n_tiles

    @gluon.jit
    def _transpose_partition(
        v_land,  # (the loader's V tiles, v_ready, kv_empty)
        vt_ring,  # (V^T tiles, vt_ready, vt_empty)
        items_ptr,
        num_items,
        first,
        end,
        step,
        BLOCK_N: gl.constexpr,
    ):
        """Each V tile the loader lands, [tokens, D], into the V^T ring as [D, tokens]: FP8 wgmma
        reads B K-major only, and P V's K is the tokens. 4 x 4 bytes a thread, so that both the load
        and the store move 4 contiguous bytes."""
        v8, v_ready, kv_empty = v_land
        vt_bufs, vt_ready, vt_empty = vt_ring
        STAGES: gl.constexpr = v8.shape[0]
        VT: gl.constexpr = vt_bufs.shape[0]
        layout: gl.constexpr = gl.BlockedLayout([4, 4], [4, 8], [gl.num_warps(), 1], [1, 0])
        c = 0
        for t in range(first, end, step):
            _base, _lo, _hi, _len, n_tiles = _item_range(items_ptr, t, num_items, BLOCK_N)
            for _i in range(n_tiles):
                mbarrier.wait(v_ready.index(c % STAGES), (c // STAGES) & 1)
                tile = v8.index(c % STAGES).load(layout)
                gl.thread_barrier()  # every warp's loads before the one arrival
                mbarrier.arrive(kv_empty.index(c % STAGES), count=1)  # the loader may refill the slot
                mbarrier.wait(vt_empty.index(c % VT), ((c // VT) & 1) ^ 1)  # a fresh barrier passes phase 1
                vt_bufs.index(c % VT).store(gl.permute(tile, (1, 0)))
                fence_async_shared()  # generic stores before the wgmma's async reads
                gl.thread_barrier()  # every thread's part before the one arrival
                mbarrier.arrive(vt_ready.index(c % VT), count=1)
                c += 1

    @gluon.jit(do_not_specialize=["num_items"])  # a step's work list length (compile_watch)
    def shared_fp8mma_kernel(
        q_ptr,  # [T, Hq, D] (rotated, times K's scale: kv_quant)
        k_ptr,  # the e4m3 caches themselves: unused, where the other shared kernels have them
        v_ptr,
        k_desc,  # TMA descriptors over the caches as rows [num_blocks * block_size, Hkv * D]
        v_desc,
        seg_rows_ptr,
        items_ptr,  # [I, 7] int32 (shared_attention.ITEM_FIELDS; field 6 = cache row of kv_lo)
        o_ptr,  # [slots, Hq, D] fp32
        lse_ptr,  # [slots, Hq] fp32
        qk_scale,  # softmax scale x log2(e)
        num_items,
        kv_heads,
        stride_qt,
        stride_qh,
        stride_op,
        stride_oh,
        stride_lp,
        GROUP: gl.constexpr,
        BLOCK_N: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        STAGES: gl.constexpr,
        VT_STAGES: gl.constexpr,
        CONSUMER_REGS: gl.constexpr,
        TRANSPOSE_REGS: gl.constexpr,
    ):
        # a Gluon kernel body: shared memory, barriers and the partitions' wiring, kept in one piece
        """Grid (work items, KV heads), 128-row tiles: two consumer warpgroups, the transposing
        warpgroup and the loader warp over one ticket each program."""
        first = gl.program_id(0) + gl.program_id(1) * num_items
        end, step = first + 1, 1
        BLOCK_M: gl.constexpr = 128
        PART_M: gl.constexpr = 64
        e4m3: gl.constexpr = gl.float8e4nv
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], e4m3)
        q8_rows = gl.allocate_shared_memory(e4m3, [BLOCK_M, HEAD_DIM], q_layout)
        k_bufs = gl.allocate_shared_memory(e4m3, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_bufs = gl.allocate_shared_memory(e4m3, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
        vt_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEAD_DIM, BLOCK_N], e4m3)
        vt_bufs = gl.allocate_shared_memory(e4m3, [VT_STAGES, HEAD_DIM, BLOCK_N], vt_layout)
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        vt_ready = gl.allocate_shared_memory(gl.int64, [VT_STAGES, 1], mbarrier.MBarrierLayout())
        vt_empty = gl.allocate_shared_memory(gl.int64, [VT_STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            # both consumers read K, the transposer reads V: the loader refills after all three
            mbarrier.init(kv_empty.index(i), count=BLOCK_M // PART_M + 1)
        for i in gl.static_range(VT_STAGES):
            mbarrier.init(vt_ready.index(i), count=1)
            mbarrier.init(vt_empty.index(i), count=BLOCK_M // PART_M)
        fence_async_shared()  # the barrier inits before any async use
        ring = (k_bufs, v_bufs, k_ready, v_ready, kv_empty)
        vt_ring = (vt_bufs, vt_ready, vt_empty)
        shared = (q8_rows, ring, vt_ring, q_ptr, seg_rows_ptr, items_ptr, o_ptr, lse_ptr, qk_scale)
        shared += (num_items, first, end, step, stride_qt, stride_qh, stride_op, stride_oh, stride_lp)
        loads = (k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, kv_empty)
        loads += (items_ptr, num_items, first, end, step, BLOCK_N, HEAD_DIM, STAGES)
        turn = ((v_bufs, v_ready, kv_empty), vt_ring, items_ptr, num_items, first, end, step, BLOCK_N)
        gl.warp_specialize(
            [
                (_consumer_fp8, (0, shared, GROUP, BLOCK_M, PART_M, BLOCK_N, HEAD_DIM)),
                (_consumer_fp8, (PART_M, shared, GROUP, BLOCK_M, PART_M, BLOCK_N, HEAD_DIM)),
                (_transpose_partition, turn),
                (_load_partition, loads),
            ],
            [4, 4, 1],
            [CONSUMER_REGS, TRANSPOSE_REGS, 24],
        )


# At launch 16 warps share the register file (maxnreg 128), then two consumer warpgroups at 216, the
# transposer at 56 and the loader warp's group at 24: 2 x 128 x 216 + 128 x 56 + 128 x 24 = 65,536.
# (At 200 / 88 the consumers spilled 216 bytes; at 216 / 56 ptxas spills nothing, and the kernel ran
# 1.12-1.20x faster: docs/kernels.md §2.13.)
# Shared memory: q 16 KB, the loader's ring 3 x 32 KB, the V^T ring 2 x 16 KB (144 KB of 227).
MAXNREG = 128
CONSUMER_REGS = 216
TRANSPOSE_REGS = 56
STAGES = 3
VT_STAGES = 2
BLOCK_N = 128


# whether the engine takes this kernel over an e4m3 cache (else the widening kernel runs): on, as
# measured faster in the engine's decode graphs and within the accuracy bounds (docs/kernels.md §2.13)
DEFAULT_ON = True
_TAKEN = {"on": DEFAULT_ON}


@contextmanager
def products(enabled: bool) -> Iterator[None]:
    """Within the block, shared segments over an e4m3 cache run their products on FP8 tensor cores
    (True) or widened to q's dtype (False): A/B runs."""
    before = _TAKEN["on"]
    _TAKEN["on"] = bool(enabled)
    try:
        yield
    finally:
        _TAKEN["on"] = before


def taken(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_m: int) -> bool:
    """Whether this kernel runs the work list: switched on (``products``) and ``eligible``."""
    return _TAKEN["on"] and eligible(q, k_cache, v_cache, block_m)


def eligible(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_m: int) -> bool:
    """True where this kernel runs a TMA work list: a Hopper GPU with Gluon, 16-bit q with d 64 or 128
    over contiguous e4m3 caches, 128-row tiles."""
    return (
        shared_gluon.eligible_for(q.device, q.dtype, q.shape[-1])
        and k_cache.dtype == v_cache.dtype == torch.float8_e4m3fn
        and block_m == 128
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
    )


def launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seg_rows: torch.Tensor,
    items: torch.Tensor,
    o_part: torch.Tensor,
    lse_part: torch.Tensor,
    scale: float,
) -> Launch:
    """Run ``shared_fp8mma_kernel`` over a 128-row TMA work list (every item's field 6 a cache row);
    the recorded launch remakes args 3-4 (the descriptors) from a later layer's caches, as
    ``shared_gluon.launch_shared_gluon``'s does."""
    q_heads, dim = q.shape[1:]
    kv_heads = k_cache.shape[2]
    args = shared_gluon.ticket_args(
        (q, k_cache, v_cache), seg_rows, items, (o_part, lse_part), scale, BLOCK_N
    )
    kw = dict(
        GROUP=q_heads // kv_heads,
        BLOCK_N=BLOCK_N,
        HEAD_DIM=dim,
        STAGES=STAGES,
        VT_STAGES=VT_STAGES,
        CONSUMER_REGS=CONSUMER_REGS,
        TRANSPOSE_REGS=TRANSPOSE_REGS,
        num_warps=4,  # the default partition: one consumer warpgroup
        maxnreg=MAXNREG,
    )
    return shared_gluon.launch_recorded(shared_fp8mma_kernel, (items.shape[0], kv_heads), args, kw, BLOCK_N)


__all__ = ["DEFAULT_ON", "GLUON", "P_SCALE", "eligible", "launch", "products", "taken"]
