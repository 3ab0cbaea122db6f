"""One Hopper kernel for a decode step whose shared products dominate: each program runs its shared
tickets first and then, in the same shared memory, its own KV.

Why: the mixed kernel (``mixed_gluon.py``) streams the own KV beside the shared tiles, and pays for it
in the shared products: its second ring leaves the shared tiles 64 tokens and no in-warpgroup
overlap, 24-27% slower than the shared kernel alone (docs/kernels.md §2.5). Where the shared part is
many times the own one (a long shared prefix, short own parts: ``mixed_rule.SHARED_HEAVY``) that
costs more than the overlap hides. Two kernels in a row (shared, then own) pay the own kernel's
latency instead, about 12 us a layer however short the own parts. Here a program runs the shared
kernel's own loop (``shared_gluon._consumer_partition``: 128-token tiles, a 3-deep ring, queries in
shared memory, QK(j+1) before softmax(j)) over every SM-th shared ticket, then streams its share of
the own tickets through the same ring memory, viewed as a 6-deep ring of own tiles
(``mixed_own.py``'s loads and transposed products), with no kernel boundary in between. The own
phase needs no second warpgroup: one keeps up with the copy rate at these tile counts.

Roles: warpgroup 0 (the default partition) takes rows 0-63 of each shared tile and then every own
tile; warpgroup 1 rows 64-127; one loader warp issues the shared tiles and then the own tiles, once
both warpgroups have released the last shared slot (``phase``: an mbarrier each warpgroup arrives on
when its shared tickets are done). Warpgroup 0's own query heads and P^T live in its half of the
query buffer, which it alone reads by then.
"""

from __future__ import annotations

import torch

from prefixserve.attention.kernels.gluon_attend import GLUON, LOG2E, gluon_descriptor
from prefixserve.attention.kernels.launch import Launch, record
from prefixserve.attention.kernels.mixed_rule import OWN_M, own_tiling

if GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

    from prefixserve.attention.kernels.gluon_attend import _load_partition
    from prefixserve.attention.kernels.mixed_gluon import own_descriptor
    from prefixserve.attention.kernels.mixed_own import _own_consumer, _own_load
    from prefixserve.attention.kernels.shared_gluon import _consumer_partition

# the shared kernel's shipped tiles (docs/kernels.md §2.3): 128 tokens, three slots
SHARED_N = 128
SHARED_STAGES = 3
MAXNREG = 168  # as shared_gluon: 240 registers for each consumer warpgroup, 24 for the loaders
# the share of programs that run their own tickets first: while they stream own KV the others run
# shared products, so each streaming SM gets a larger share of the copy rate
OWN_FIRST_SHARE = 0.5

if GLUON:

    @gluon.jit
    def _phased_consumer(
        m_off: gl.constexpr,
        shared,  # as shared_gluon._consumer_partition's
        own,  # (own ring, (Q^T rows, P^T), own walk, own pointers, phase barrier, own first)
        GROUP: gl.constexpr,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        STAGES: gl.constexpr,
        HT: gl.constexpr,
        W: gl.constexpr,  # which warpgroup: its own ring is slots W * RING .. + RING
        RING: gl.constexpr,
    ):
        """A consumer warpgroup: its rows of the program's shared tickets and its half of the program's
        own tickets, in the program's order; it arrives on the phase barrier between the two."""
        ring, own_smem, walk, ptrs, phase, own_first = own
        # between the phases, both warpgroups wait for each other: the own phase's Q^T and P^T and the
        # shared phase's query rows share the query buffer, whose rows the NVMMA layout interleaves
        if own_first:
            _own_consumer(ring, own_smem, walk, ptrs, GROUP, HEAD_DIM, HT, True, W * RING, RING)
            mbarrier.arrive(phase, count=1)  # this warpgroup is done with its own ring
            mbarrier.wait(phase, 0)
            _consumer_partition(m_off, shared, GROUP, BLOCK_M, BLOCK_M // 2, BLOCK_N, HEAD_DIM, STAGES)
        else:
            _consumer_partition(m_off, shared, GROUP, BLOCK_M, BLOCK_M // 2, BLOCK_N, HEAD_DIM, STAGES)
            mbarrier.arrive(phase, count=1)  # this warpgroup is done with the shared ring
            mbarrier.wait(phase, 0)
            _own_consumer(ring, own_smem, walk, ptrs, GROUP, HEAD_DIM, HT, True, W * RING, RING)

    @gluon.jit
    def _phased_load(
        shared_load,  # _load_partition's arguments before its constexprs
        own_load,  # (own K / V descriptors, warpgroup 0's own ring and walk, phase barrier, own first)
        BLOCK_N: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        STAGES: gl.constexpr,
        BLOCK_SIZE: gl.constexpr,
        HT: gl.constexpr,
        RING: gl.constexpr,
    ):
        """The first loader warp: the shared tickets' tiles and warpgroup 0's own tiles, in the program's
        order; the second phase's loads wait until both warpgroups are done with the first's memory."""
        k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, kv_empty, items_ptr, num_items, first, end, step = (
            shared_load
        )
        ko_desc, vo_desc, ring, walk, phase, own_first = own_load
        if own_first:
            _own_load(ko_desc, vo_desc, ring, walk, HEAD_DIM, BLOCK_SIZE, HT, 0, RING)
            mbarrier.wait(phase, 0)
        # fmt: off
        _load_partition(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, kv_empty, items_ptr, num_items,
                        first, end, step, BLOCK_N, HEAD_DIM, STAGES)
        # fmt: on
        if not own_first:
            mbarrier.wait(phase, 0)
            _own_load(ko_desc, vo_desc, ring, walk, HEAD_DIM, BLOCK_SIZE, HT, 0, RING)

    @gluon.jit
    def _phased_own_load(
        own_load,  # (own K / V descriptors, warpgroup 1's own ring and walk, phase barrier, own first)
        HEAD_DIM: gl.constexpr,
        BLOCK_SIZE: gl.constexpr,
        HT: gl.constexpr,
        RING: gl.constexpr,
    ):
        """The second loader warp: warpgroup 1's own tiles (after the shared phase where that comes
        first)."""
        ko_desc, vo_desc, ring, walk, phase, own_first = own_load
        if not own_first:
            mbarrier.wait(phase, 0)
        _own_load(ko_desc, vo_desc, ring, walk, HEAD_DIM, BLOCK_SIZE, HT, RING, RING)

    @gluon.jit
    def _own_views(q_smem, w: gl.constexpr, OWN_M: gl.constexpr, OWN_ROWS: gl.constexpr):
        """Warpgroup w's own Q^T rows and P^T in the query buffer (its first or second half by address,
        which is not its query rows' half: the phases do not overlap in it)."""
        dtype: gl.constexpr = q_smem.dtype
        BLOCK_M: gl.constexpr = q_smem.shape[0]
        HEAD_DIM: gl.constexpr = q_smem.shape[1]
        half: gl.constexpr = w * (BLOCK_M // 2) * HEAD_DIM  # elements before the half
        qo_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([OWN_ROWS, HEAD_DIM], dtype)
        qo_n: gl.constexpr = OWN_ROWS * HEAD_DIM
        qo = q_smem._reinterpret(dtype, [BLOCK_M * HEAD_DIM // qo_n, OWN_ROWS, HEAD_DIM], qo_layout)
        pt_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([OWN_M, OWN_ROWS], dtype)
        pt_n: gl.constexpr = OWN_M * OWN_ROWS
        pt = q_smem._reinterpret(dtype, [BLOCK_M * HEAD_DIM // pt_n, OWN_M, OWN_ROWS], pt_layout)
        return qo.index(half // qo_n), pt.index((half + qo_n + pt_n - 1) // pt_n)

    @gluon.jit
    def phased_gluon_kernel(
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
        own_first_from,  # programs from this one run their own tickets first
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
        OWN_M: gl.constexpr,
        OWN_ROWS: gl.constexpr,
        HT: gl.constexpr,
    ):
        # a Gluon kernel body: shared memory, its two views, barriers and the partitions' wiring
        """1-d grid of G programs (one per SM): program p takes shared tickets p, p + G, ... (item
        fastest) and own tickets [p n / G, (p + 1) n / G) of the n = sequences x KV head groups of HT
        heads, split between its two warpgroups; programs from ``own_first_from`` run the own tickets
        first, so that part of the SMs stream own KV while the others run products."""
        p = gl.program_id(0)
        n_programs = gl.num_programs(0)
        own_first = p >= own_first_from
        groups = kv_heads // HT
        n_own = num_seqs * groups
        u_lo = (p * n_own) // n_programs
        u_hi = ((p + 1) * n_own) // n_programs
        u_mid = (u_lo + u_hi) // 2
        dtype: gl.constexpr = q_ptr.dtype.element_ty
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_layout)
        k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)  # noqa: RUF005
        v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)  # noqa: RUF005
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        # the own phase's views of the same memory: the K ring as own K tiles, the V ring as own V
        # tiles (STAGES x BLOCK_N / OWN_M slots each), half the slots for each warpgroup's ring
        OWN_SLOTS: gl.constexpr = STAGES * BLOCK_N // OWN_M
        RING: gl.constexpr = OWN_SLOTS // 2
        own_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([OWN_M, HEAD_DIM], dtype)
        ko_bufs = k_bufs._reinterpret(dtype, [OWN_SLOTS, OWN_M, HEAD_DIM], own_layout)
        vo_bufs = v_bufs._reinterpret(dtype, [OWN_SLOTS, OWN_M, HEAD_DIM], own_layout)
        own_ready = gl.allocate_shared_memory(gl.int64, [OWN_SLOTS, 1], mbarrier.MBarrierLayout())
        own_empty = gl.allocate_shared_memory(gl.int64, [OWN_SLOTS, 1], mbarrier.MBarrierLayout())
        phase = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=2)  # both consumers free the slot
        for i in gl.static_range(OWN_SLOTS):
            mbarrier.init(own_ready.index(i), count=1)
            mbarrier.init(own_empty.index(i), count=1)
        mbarrier.init(phase.index(0), count=2)  # both warpgroups done with the first phase's memory
        fence_async_shared()  # the barrier inits before any async use
        t_end = num_items * kv_heads
        shared = (
            q_smem,
            k_bufs,
            v_bufs,
            k_ready,
            v_ready,
            kv_empty,
            q_ptr,
            seg_rows_ptr,
            items_ptr,
            o_ptr,
            lse_ptr,
            qk_scale,
            num_items,
            p,
            t_end,
            n_programs,
            stride_qt,
            stride_qh,
            stride_op,
            stride_oh,
            stride_lp,
        )
        ring = (ko_bufs, vo_bufs, own_ready, own_empty)  # warpgroup w: slots w * RING .. + RING
        walk0 = (own_tables_ptr, own_lens_ptr, table_stride, groups, u_lo, u_mid, oob_row)
        walk1 = (own_tables_ptr, own_lens_ptr, table_stride, groups, u_mid, u_hi, oob_row)
        strides = (stride_qt, stride_qh, stride_op, stride_oh, stride_lp)
        own_ptrs = (q_ptr, o_ptr, lse_ptr, qk_scale, own_slot0) + strides  # noqa: RUF005
        bar = phase.index(0)
        own0 = (ring, _own_views(q_smem, 0, OWN_M, OWN_ROWS), walk0, own_ptrs, bar, own_first)
        own1 = (ring, _own_views(q_smem, 1, OWN_M, OWN_ROWS), walk1, own_ptrs, bar, own_first)
        shared_load = (k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, kv_empty, items_ptr, num_items)
        shared_load = shared_load + (p, t_end, n_programs)  # noqa: RUF005
        own_load0 = (ko_desc, vo_desc, ring, walk0, bar, own_first)
        own_load1 = (ko_desc, vo_desc, ring, walk1, bar, own_first)
        gl.warp_specialize(
            [
                (_phased_consumer, (0, shared, own0, GROUP, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, HT, 0, RING)),
                (
                    _phased_consumer,
                    (BLOCK_M // 2, shared, own1, GROUP, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, HT, 1, RING),
                ),
                (_phased_load, (shared_load, own_load0, BLOCK_N, HEAD_DIM, STAGES, BLOCK_SIZE, HT, RING)),
                (_phased_own_load, (own_load1, HEAD_DIM, BLOCK_SIZE, HT, RING)),
            ],
            [4, 1, 1],
            [240, 24, 24],
        )


def launch_phased(
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
    own_first_from: int | None = None,
) -> Launch:
    """Run ``phased_gluon_kernel`` on ``programs`` programs (one per SM), own tiles of ``OWN_M`` rows;
    programs from ``own_first_from`` (default: the last ``OWN_FIRST_SHARE`` of them) run their own
    tickets first.

    Takes and writes what ``mixed_gluon.launch_mixed`` does (shared partials where the work list's
    items say, own partials of sequence s at ``own_slot0 + s``); returns the recorded launch, whose
    descriptors (args 3-6) are remade from a later layer's caches.
    """
    q_heads, dim = q.shape[1:]
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    heads_per_tile, own_rows = own_tiling(q_heads, kv_heads, block_size, OWN_M)
    args = (
        q,
        k_cache,
        v_cache,
        gluon_descriptor(k_cache, SHARED_N),
        gluon_descriptor(v_cache, SHARED_N),
        own_descriptor(k_cache, OWN_M),
        own_descriptor(v_cache, OWN_M),
        seg_rows,
        items,
        o_part,
        lse_part,
        own_tables,
        own_lens,
        scale * LOG2E,
        items.shape[0],
        kv_heads,
        own_lens.shape[0],
        own_tables.stride(0),
        own_slot0,
        num_blocks * block_size,
        programs - round(programs * OWN_FIRST_SHARE) if own_first_from is None else own_first_from,
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
        STAGES=SHARED_STAGES,
        OWN_M=OWN_M,
        OWN_ROWS=own_rows,
        HT=heads_per_tile,
        num_warps=4,  # the default partition: consumer warpgroup 0
        maxnreg=MAXNREG,
    )
    grid = (programs,)
    compiled = phased_gluon_kernel[grid](*args, **kw)
    launch = record(phased_gluon_kernel, grid, args, kw, compiled)
    shared = lambda c: gluon_descriptor(c, SHARED_N)  # noqa: E731
    own = lambda c: own_descriptor(c, OWN_M)  # noqa: E731
    launch.derived = [(3, 1, shared), (4, 2, shared), (5, 1, own), (6, 2, own)]
    return launch


__all__ = ["launch_phased"]
