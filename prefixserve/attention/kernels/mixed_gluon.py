"""One Hopper kernel for a decode step's shared tiles and own KV, run side by side in every program.

Why: the shared kernel (``shared_gluon.py``) holds an SM's whole shared memory and register file
while it runs, so the own kernel's KV streams only before or after it and a bytes-bound step costs
about shared + own (docs/kernels.md §2.4). Here one program per SM walks every SM-th shared ticket
(item, KV head) and an even share of the own tickets (sequence, group of KV heads) at the same time,
with separate roles:

- two shared warpgroups (64 query rows each) run the shared ticket's tiles (``_attend_tiles``, the
  shared kernel's loop), their query rows in registers, fed by a loader warp through a 3-deep ring
  of ``SHARED_N``-token tiles;
- one own warpgroup runs the own tiles, fed by a second loader warp through its own 3-deep ring.

Two rings, so that a shared tile held for its products never keeps the own tiles behind it out of
flight, and a warpgroup of its own for the own math, so that it never waits behind a shared tile
(docs/kernels.md §2.5; one ring for both kinds of tile, on the same two warpgroups, lost: §4).
Programs without a shared ticket stream own KV only.

The own tiles (tickets, loads, the transposed products) are ``mixed_own.py``'s; the rule that takes a
step to this kernel is ``planning/mixed_rule.py``'s.
"""

from __future__ import annotations

from typing import Any

import torch

from prefixserve.attention import _ptxas
from prefixserve.attention.kernels.gluon_attend import GLUON, LOG2E, gluon_descriptor, tile_layout
from prefixserve.attention.planning.mixed_rule import HEAVY_SHARED_N, OWN_M, SHARED_N, own_tiling
from prefixserve.triton_support.launch import Launch, record

if GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from prefixserve.attention.kernels.gluon_attend import (
        _item_range,
        _load_partition,
        _run_ticket,
        _ticket_query,
    )
    from prefixserve.attention.kernels.mixed_own import _own_consumer, _own_load

# The ring shapes (docs/kernels.md §2.5; other shapes lost, §4): the shared ring holds SHARED_N = 64-token
# tiles, so that with the own ring beside it (64-row tiles) both stay three deep in shared memory; in
# shared-heavy steps 128-token ones, two slots of each ring (``mixed_rule.shared_tokens_for``)
SHARED_STAGES = 3
OWN_STAGES = 3
# registers a thread: the shared warpgroups and the own one; the loader warps' warpgroup keeps 24 and
# the default partition (a shared warpgroup) what is left: 2 x SHARED + OWN + 24 = 512
MAXNREG = 128  # 16 warps x 32 threads x 128 = 65,536 at launch
SHARED_REGS = 192
OWN_REGS = 512 - 2 * SHARED_REGS - 24

if GLUON:
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

    @gluon.jit(do_not_specialize=["num_items", "num_seqs", "table_stride", "own_slot0"])  # per step
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
        count_ptr,  # [1] int32: the work list's items in use (``COUNTED``; else unused)
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
        COUNTED: gl.constexpr = False,  # the items in use at ``count_ptr``, not ``num_items`` (graphs)
    ):
        # a Gluon kernel body: shared memory, barriers and the five partitions' wiring, kept in one piece
        """1-d grid of G programs (one per SM): program p takes shared tickets p, p + G, ... (item
        fastest) and own tickets [p n / G, (p + 1) n / G) of the n = sequences x KV head groups of HT
        heads."""
        if COUNTED:  # a graph's work list is a fixed capacity: walk only the items this step uses
            num_items = gl.load(count_ptr)
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
    return TensorDescriptor.from_tensor(rows, [block_size, dim], tile_layout(block_n, dim, cache.dtype))


def ring_stages(own_m: int, shared_n: int = SHARED_N) -> tuple[int, int]:
    """(shared, own) ring slots: three of each with 64-row own tiles and 64-token shared tiles (32 KB +
    32 KB a slot), two of each with 128-row own tiles (32 KB + 64 KB) or 128-token shared tiles (64 KB
    + 32 KB), in the 227 KB of an SM's shared memory."""
    if shared_n not in (SHARED_N, HEAVY_SHARED_N):
        raise ValueError(f"shared tiles of {shared_n} tokens: {SHARED_N} or {HEAVY_SHARED_N}")
    if own_m != OWN_M and shared_n != SHARED_N:
        raise ValueError(f"{own_m}-row own tiles and {shared_n}-token shared tiles do not fit shared memory")
    return (SHARED_STAGES, OWN_STAGES) if (own_m, shared_n) == (OWN_M, SHARED_N) else (2, 2)


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
    shared_n: int = SHARED_N,
    count: torch.Tensor | None = None,
) -> Launch:
    """Run ``mixed_gluon_kernel`` on ``programs`` programs (one per SM), with own tiles of ``own_m``
    rows (``own_rows_for``) and shared tiles of ``shared_n`` tokens (``shared_tokens_for``).
    ``count``: a [1] int32 device tensor holding how many of ``items``' rows are in use (a decode
    graph's work list is a capacity, mostly zero items; walking them cost 12% of an 8B step at B=256);
    None: all of them.

    Shared partials go where the work list's items say; own partials of sequence s (a decode step:
    query row s) to slot ``own_slot0 + s``. Returns the recorded
    launch, whose descriptors (args 3-6) are remade from a later layer's caches.
    """
    if own_m != OWN_M and not NEWER_PTXAS:
        raise RuntimeError(
            f"{own_m}-row own tiles need ptxas >= 12.9 (12.8 miscompiles them; docs/kernels.md §2.5)"
        )
    q_heads, dim = q.shape[1:]
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    heads_per_tile, own_rows = own_tiling(q_heads, kv_heads, block_size, own_m)
    shared_stages, own_stages = ring_stages(own_m, shared_n)  # refuses shapes that do not fit
    args = (
        q,
        k_cache,
        v_cache,
        gluon_descriptor(k_cache, shared_n),
        gluon_descriptor(v_cache, shared_n),
        own_descriptor(k_cache, own_m),
        own_descriptor(v_cache, own_m),
        seg_rows,
        items,
        o_part,
        lse_part,
        own_tables,
        own_lens,
        items if count is None else count,
        scale * LOG2E,
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
        BLOCK_N=shared_n,
        HEAD_DIM=dim,
        BLOCK_SIZE=block_size,
        STAGES=shared_stages,
        OWN_STAGES=own_stages,
        OWN_M=own_m,
        OWN_ROWS=own_rows,
        HT=heads_per_tile,
        PTXAS=PTXAS_BUILD,
        COUNTED=count is not None,
        num_warps=4,  # the default partition: one shared warpgroup
        maxnreg=MAXNREG,
    )
    grid = (programs,)
    compiled = mixed_gluon_kernel[grid](*args, **kw)
    launch = record(mixed_gluon_kernel, grid, args, kw, compiled)
    shared = lambda c: gluon_descriptor(c, shared_n)  # noqa: E731
    own = lambda c: own_descriptor(c, own_m)  # noqa: E731
    launch.derived = [(3, 1, shared), (4, 2, shared), (5, 1, own), (6, 2, own)]
    return launch


__all__ = ["launch_mixed", "own_descriptor", "ring_stages"]
