"""Warp-specialised shared-segment kernel for Hopper, written in Gluon (Triton's explicit-layout dialect).

Same work items and partial slots as ``shared_attention._shared_kernel`` on its TMA path (tall
128-row tiles over contiguous segments), but the roles inside a program are split the way FA3 splits
them: one loader warp walks the segment issuing TMA loads of K and V tiles into a 3-deep ring of
shared-memory buffers, and two consumer warpgroups of 64 rows, each its own partition,
gather their query rows, wait on mbarriers, run the wgmma products and the online softmax. Apart,
the two warpgroups drift so that one's softmax runs beside the other's products, and each issues
tile j+1's Q @ K^T before tile j's softmax (FA3's intra-warpgroup overlap, ``_attend_tiles``'s
``OVERLAP``; the mixed kernel runs the same loop without it). The loader keeps
24 registers, the consumers get 240. Measured 1.2-1.4x the Triton kernel alone (docs/kernels.md §2.3).

192-row tiles (``shared_plan.WIDE_M``) run three consumer warpgroups of 160 registers without the
in-warpgroup overlap (there is no room for it), on 128-token K/V tiles in two ring slots: each
program reads its segment's K and V from L2 for 1.5x the rows, which at the power cap is energy off
every call (docs/kernels.md §2.3).

A program takes one (work item, KV head) ticket; the partitions walk tickets first .. end with a
step (here one ticket), so that the mixed kernel (``mixed_gluon.py``), whose programs walk every
SM-th ticket, runs the same loader and ticket code.
The loader, the ticket loop and the row stores are ``gluon_attend.py``'s; the kernel here holds the
consumer partitions and the ring.
"""

from __future__ import annotations

from typing import Any

import torch

from prefixserve.attention.kernels.gluon_attend import GL_DTYPES, GLUON, LOG2E, gluon_descriptor
from prefixserve.triton_support.launch import Launch, record

if GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

    from prefixserve.attention.kernels.gluon_attend import (
        _item_range,
        _load_partition,
        _run_ticket,
        _ticket_query,
    )

if GLUON:

    @gluon.jit
    def _consumer_partition(
        m_off,
        shared,  # (q_smem, ring buffers and barriers, pointers, the ticket walk, strides): see the kernel
        GROUP: gl.constexpr,
        BLOCK_M: gl.constexpr,
        PART_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        STAGES: gl.constexpr,
        OVERLAP: gl.constexpr,
    ):
        """One warpgroup's rows m_off .. m_off + PART_M of every ticket's tile: gathered, attended, stored
        (with the in-warpgroup overlap: ``_attend_tiles``'s ``OVERLAP``)."""
        (
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
        q_part = q_smem.slice(m_off, PART_M)
        c = 0
        for t in range(first, end, step):
            base, row_lo, row_hi, kv_len, n_tiles = _item_range(items_ptr, t, num_items, BLOCK_N)
            kvh = t // num_items
            q_rows = (q_ptr, seg_rows_ptr, row_lo, row_hi, kvh, stride_qt, stride_qh)
            q_part.store(_ticket_query(q_rows, m_off, GROUP, BLOCK_M, PART_M, HEAD_DIM, ld))
            fence_async_shared()  # generic stores before the wgmma's async reads
            ring = (k_bufs, v_bufs, k_ready, v_ready, kv_empty)
            ticket = (base, row_lo, row_hi, kv_len, n_tiles, kvh)
            out = (o_ptr, lse_ptr, stride_op, stride_oh, stride_lp)
            _run_ticket(
                q_part, ring, c, ticket, out, qk_scale, m_off, GROUP, BLOCK_M, BLOCK_N, HEAD_DIM, OVERLAP
            )
            c += n_tiles

    @gluon.jit
    def _widen_partition(
        src,  # (e4m3 K tiles, e4m3 V tiles, k_ready, v_ready, empty): the ring the loader fills
        dst,  # (K tiles, V tiles, k_ready, v_ready, empty) in q's dtype: the ring the consumers read
        items_ptr,
        num_items,
        first,
        end,
        step,
        BLOCK_N: gl.constexpr,
    ):
        """An FP8 KV cache's widening warpgroup: each e4m3 K and V tile the loader lands is converted to
        q's dtype (exact: e4m3 fits bf16 and fp16) into the consumers' ring, once for all of them, so
        the consumers run as over a cache of q's dtype."""
        k8, v8, k8_ready, v8_ready, k8_empty = src
        k16, v16, k16_ready, v16_ready, k16_empty = dst
        S8: gl.constexpr = k8.shape[0]
        S16: gl.constexpr = k16.shape[0]
        TILE_N: gl.constexpr = k8.shape[1]  # (partition arguments lose constexpr: shapes keep it)
        # rows at a time: the conversion waits on each shared-memory load, so the more rows a thread
        # has in flight, the faster (8 / 16 / 32 / 64 of a 128-token tile: 421 / 280 / 254 / 234 us a
        # B=256, P=16K call; docs/kernels.md §2.13), as registers allow: half of a 128-token tile
        # (128-row tiles), 16 of a 64-token one (192-row tiles: more spilled, and the wgmmas serialised)
        WIDEN_ROWS: gl.constexpr = 64 if TILE_N == 128 else 16
        DIM: gl.constexpr = k8.shape[2]
        COLS: gl.constexpr = DIM // 16  # threads across a row, 16 bytes each
        layout: gl.constexpr = gl.BlockedLayout([1, 16], [32 // COLS, COLS], [gl.num_warps(), 1], [1, 0])
        c = 0
        for t in range(first, end, step):
            _base, _lo, _hi, _len, n_tiles = _item_range(items_ptr, t, num_items, BLOCK_N)
            for _i in range(n_tiles):
                s8, s16 = c % S8, c % S16
                mbarrier.wait(k16_empty.index(s16), ((c // S16) & 1) ^ 1)  # a fresh barrier passes phase 1
                mbarrier.wait(k8_ready.index(s8), (c // S8) & 1)
                for r in gl.static_range(0, TILE_N, WIDEN_ROWS):
                    tile = k8.index(s8).slice(r, WIDEN_ROWS).load(layout)
                    k16.index(s16).slice(r, WIDEN_ROWS).store(tile.to(k16.dtype))
                fence_async_shared()  # generic stores before the wgmma's async reads
                gl.thread_barrier()  # every thread's rows before the one arrival
                mbarrier.arrive(k16_ready.index(s16), count=1)
                mbarrier.wait(v8_ready.index(s8), (c // S8) & 1)
                for r in gl.static_range(0, TILE_N, WIDEN_ROWS):
                    tile = v8.index(s8).slice(r, WIDEN_ROWS).load(layout)
                    v16.index(s16).slice(r, WIDEN_ROWS).store(tile.to(v16.dtype))
                fence_async_shared()
                gl.thread_barrier()
                mbarrier.arrive(v16_ready.index(s16), count=1)
                mbarrier.arrive(k8_empty.index(s8), count=1)  # the loader may refill the e4m3 slot
                c += 1

    @gluon.jit(do_not_specialize=["num_items"])  # a step's work list length (compile_watch)
    def shared_gluon_kernel(
        q_ptr,  # [T, Hq, D]
        k_ptr,  # the K / V caches themselves: unused here, they sit where the Triton kernel has them
        v_ptr,  # so that a recorded launch swaps a layer's caches (args 1-2) the same way
        k_desc,  # TMA descriptors over the K / V caches as rows [num_blocks * block_size, Hkv * D]
        v_desc,
        seg_rows_ptr,  # [R] int32: flat query row of each segment row
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
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        STAGES: gl.constexpr,
        OVERLAP: gl.constexpr,  # QK(j+1) before softmax(j) in each consumer warpgroup
        CONSUMER_REGS: gl.constexpr,  # registers a consumer thread
        WIDEN_STAGES: gl.constexpr = 0,  # an e4m3 cache: slots of the ring its tiles land in
        WIDEN_REGS: gl.constexpr = 0,  # and its widening warpgroup's registers a thread
    ):
        # a Gluon kernel body: shared memory, barriers and the partitions' wiring, kept in one piece
        """Grid (work items, KV heads): one ticket (item, head) per program. A ticket's rows x GROUP
        heads attend its KV range and land in its partial slots. Over an e4m3 cache (``WIDEN_STAGES``
        > 0) the loader fills a ring of e4m3 tiles and a widening warpgroup (``_widen_partition``)
        converts each into the consumers' ring in q's dtype."""
        first = gl.program_id(0) + gl.program_id(1) * num_items
        end, step = first + 1, 1
        # shared-memory shapes are powers of two: 192 query rows sit in a 256-row buffer
        Q_ROWS: gl.constexpr = 256 if BLOCK_M == 192 else BLOCK_M
        dtype: gl.constexpr = q_ptr.dtype.element_ty
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([Q_ROWS, HEAD_DIM], dtype)
        q_smem = gl.allocate_shared_memory(dtype, [Q_ROWS, HEAD_DIM], q_layout)
        tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
        k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], tile_layout)
        v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], tile_layout)
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        PART_M: gl.constexpr = 64  # rows of each consumer warpgroup: one wgmma's M
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=BLOCK_M // PART_M)  # every consumer frees the slot
        if WIDEN_STAGES > 0:
            k8_bufs = gl.allocate_shared_memory(
                k_desc.dtype, [WIDEN_STAGES, BLOCK_N, HEAD_DIM], k_desc.layout
            )
            v8_bufs = gl.allocate_shared_memory(
                v_desc.dtype, [WIDEN_STAGES, BLOCK_N, HEAD_DIM], v_desc.layout
            )
            k8_ready = gl.allocate_shared_memory(gl.int64, [WIDEN_STAGES, 1], mbarrier.MBarrierLayout())
            v8_ready = gl.allocate_shared_memory(gl.int64, [WIDEN_STAGES, 1], mbarrier.MBarrierLayout())
            kv8_empty = gl.allocate_shared_memory(gl.int64, [WIDEN_STAGES, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(WIDEN_STAGES):
                mbarrier.init(k8_ready.index(i), count=1)
                mbarrier.init(v8_ready.index(i), count=1)
                mbarrier.init(kv8_empty.index(i), count=1)  # the widening warpgroup frees the slot
        fence_async_shared()  # the barrier inits before any async use
        # two (or, on 192-row tiles, three) consumer warpgroups, each its own partition (one's softmax
        # beside the others' products), and the loader warp
        # what both consumer partitions read (worker partitions take scalars and shared memory only)
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
            first,
            end,
            step,
            stride_qt,
            stride_qh,
            stride_op,
            stride_oh,
            stride_lp,
        )
        ring = (k_bufs, v_bufs, k_ready, v_ready, kv_empty)
        if WIDEN_STAGES > 0:
            land = (k8_bufs, v8_bufs, k8_ready, v8_ready, kv8_empty)
            loads = (k_desc, v_desc, k8_bufs, v8_bufs, k8_ready, v8_ready, kv8_empty)
            loads += (items_ptr, num_items, first, end, step, BLOCK_N, HEAD_DIM, WIDEN_STAGES)
            widen = (land, ring, items_ptr, num_items, first, end, step, BLOCK_N)
        else:
            loads = (k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, kv_empty)
            loads += (items_ptr, num_items, first, end, step, BLOCK_N, HEAD_DIM, STAGES)
        if BLOCK_M == 3 * PART_M and WIDEN_STAGES > 0:
            gl.warp_specialize(
                [
                    (
                        _consumer_partition,
                        (0, shared, GROUP, BLOCK_M, PART_M, BLOCK_N, HEAD_DIM, STAGES, OVERLAP),
                    ),
                    (
                        _consumer_partition,
                        (PART_M, shared, GROUP, BLOCK_M, PART_M, BLOCK_N, HEAD_DIM, STAGES, OVERLAP),
                    ),
                    (
                        _consumer_partition,
                        (2 * PART_M, shared, GROUP, BLOCK_M, PART_M, BLOCK_N, HEAD_DIM, STAGES, OVERLAP),
                    ),
                    (_widen_partition, widen),
                    (_load_partition, loads),
                ],
                [4, 4, 4, 1],
                [CONSUMER_REGS, CONSUMER_REGS, WIDEN_REGS, 24],
            )
        elif BLOCK_M == 3 * PART_M:
            gl.warp_specialize(
                [
                    (
                        _consumer_partition,
                        (0, shared, GROUP, BLOCK_M, PART_M, BLOCK_N, HEAD_DIM, STAGES, OVERLAP),
                    ),
                    (
                        _consumer_partition,
                        (PART_M, shared, GROUP, BLOCK_M, PART_M, BLOCK_N, HEAD_DIM, STAGES, OVERLAP),
                    ),
                    (
                        _consumer_partition,
                        (2 * PART_M, shared, GROUP, BLOCK_M, PART_M, BLOCK_N, HEAD_DIM, STAGES, OVERLAP),
                    ),
                    (_load_partition, loads),
                ],
                [4, 4, 1],
                [CONSUMER_REGS, CONSUMER_REGS, 24],
            )
        elif WIDEN_STAGES > 0:
            gl.warp_specialize(
                [
                    (
                        _consumer_partition,
                        (0, shared, GROUP, BLOCK_M, PART_M, BLOCK_N, HEAD_DIM, STAGES, OVERLAP),
                    ),
                    (
                        _consumer_partition,
                        (PART_M, shared, GROUP, BLOCK_M, PART_M, BLOCK_N, HEAD_DIM, STAGES, OVERLAP),
                    ),
                    (_widen_partition, widen),
                    (_load_partition, loads),
                ],
                [4, 4, 1],
                [CONSUMER_REGS, WIDEN_REGS, 24],
            )
        else:
            gl.warp_specialize(
                [
                    (
                        _consumer_partition,
                        (0, shared, GROUP, BLOCK_M, PART_M, BLOCK_N, HEAD_DIM, STAGES, OVERLAP),
                    ),
                    (
                        _consumer_partition,
                        (PART_M, shared, GROUP, BLOCK_M, PART_M, BLOCK_N, HEAD_DIM, STAGES, OVERLAP),
                    ),
                    (_load_partition, loads),
                ],
                [4, 1],
                [CONSUMER_REGS, 24],
            )


# 24 registers for the loader warp (its warpgroup: 4 warps), the rest to the consumer warpgroups:
# maxnreg x 12 warps x 32 threads <= 65,536 registers
MAXNREG = 168
# 192-row tiles, three consumer warpgroups: 16 warps at launch, then 3 x 128 x 160 + 128 x 24 <= 65,536.
# At 160 registers a consumer cannot hold tile j+1's scores beside tile j's (the overlap spilled 608 B
# and ptxas serialised the wgmmas), so these tiles run without it
MAXNREG_WIDE = 128
CONSUMER_REGS = {128: 240, 192: 160}
# Over an e4m3 cache a widening warpgroup joins (FP8_WIDEN_REGS): at launch 16 warps (128-row tiles)
# or 20 (192) share the file, then 2 x 128 x 200 + 128 x 88 (or 3 x 128 x 144 + 128 x 40) + 128 x 24
# <= 65,536. Shared memory holds q, the consumers' ring in q's dtype and a 2-slot ring of e4m3 tiles:
# (K/V tile tokens, consumer ring slots) by tile rows, within 227 KB
FP8_MAXNREG = {128: 128, 192: 96}
FP8_CONSUMER_REGS = {128: 200, 192: 144}
FP8_WIDEN_REGS = {128: 88, 192: 40}
FP8_TILES = {128: (128, 2), 192: (64, 3)}
FP8_LANDING_SLOTS = 2


def eligible_for(device: torch.device | str, dtype: torch.dtype, head_dim: int) -> bool:
    """True when the Gluon kernel can run on ``device`` for this dtype and head size: a Hopper GPU
    (wgmma), 16-bit q and KV, d 64 or 128, and a Triton with Gluon (``GLUON``)."""
    device = torch.device(device)
    if not (GLUON and device.type == "cuda"):
        return False
    return torch.cuda.get_device_capability(device)[0] == 9 and dtype in GL_DTYPES and head_dim in (64, 128)


def eligible(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_m: int, block_n: int
) -> bool:
    """True when the Gluon kernel runs this TMA work list: ``eligible_for`` q, the caches of q's
    dtype or e4m3 (an FP8 KV cache, widened in shared memory) and contiguous (descriptors), 128- or
    192-row tiles (two or three 64-row consumer warpgroups)."""
    return (
        eligible_for(q.device, q.dtype, q.shape[-1])
        and k_cache.dtype == v_cache.dtype
        and k_cache.dtype in (q.dtype, torch.float8_e4m3fn)
        and block_m in (128, 192)
        and block_n in (64, 128)
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
    )


def launch_shared_gluon(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seg_rows: torch.Tensor,
    items: torch.Tensor,
    o_part: torch.Tensor,
    lse_part: torch.Tensor,
    scale: float,
    stages: int = 3,
    block_m: int = 128,
    block_n: int = 128,
) -> Launch:
    """Run ``shared_gluon_kernel`` over a TMA work list (every item's field 6 a cache row).

    Returns the recorded launch: args 0-2 are q, k_cache, v_cache and 3-4 their descriptors, remade
    from a later layer's caches on relaunch, as for the Triton kernel. The defaults are the shipped
    configuration (docs/kernels.md §2.3). Over an e4m3 cache the tiles and ring slots are
    ``FP8_TILES``'s for the tile rows, whatever was asked (the work items are token ranges).
    """
    q_heads, dim = q.shape[1:]
    kv_heads = k_cache.shape[2]
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8:
        block_n, stages = FP8_TILES[block_m]
    args = ticket_args((q, k_cache, v_cache), seg_rows, items, (o_part, lse_part), scale, block_n)
    kw = dict(
        GROUP=q_heads // kv_heads,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HEAD_DIM=dim,
        STAGES=stages,
        OVERLAP=block_m == 128,
        CONSUMER_REGS=(FP8_CONSUMER_REGS if fp8 else CONSUMER_REGS)[block_m],
        WIDEN_STAGES=FP8_LANDING_SLOTS if fp8 else 0,
        WIDEN_REGS=FP8_WIDEN_REGS[block_m] if fp8 else 0,
        num_warps=4,  # the default partition: one consumer warpgroup
        maxnreg=FP8_MAXNREG[block_m] if fp8 else (MAXNREG if block_m == 128 else MAXNREG_WIDE),
    )
    return launch_recorded(shared_gluon_kernel, (items.shape[0], kv_heads), args, kw, block_n)


def ticket_args(
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    seg_rows: torch.Tensor,
    items: torch.Tensor,
    partials: tuple[torch.Tensor, torch.Tensor],
    scale: float,
    block_n: int,
) -> tuple:
    """The positional arguments of a Gluon shared kernel (this one, ``shared_gluon_fp8``'s): q and the
    caches, their descriptors of ``block_n``-token tiles, the work list, the partial slots (o, lse),
    the scale in log2 units and the strides."""
    q, k_cache, v_cache = qkv
    o_part, lse_part = partials
    descs = (gluon_descriptor(k_cache, block_n), gluon_descriptor(v_cache, block_n))
    sizes = (scale * LOG2E, items.shape[0], k_cache.shape[2])
    strides = (q.stride(0), q.stride(1), o_part.stride(0), o_part.stride(1), lse_part.stride(0))
    return (*qkv, *descs, seg_rows, items, o_part, lse_part, *sizes, *strides)


def launch_recorded(kernel: Any, grid: tuple[int, int], args: tuple, kw: dict, block_n: int) -> Launch:
    """Launch ``kernel`` and record it so that a relaunch for another layer's caches (args 1-2) remakes
    their descriptors (args 3-4)."""
    compiled = kernel[grid](*args, **kw)
    launch = record(kernel, grid, args, kw, compiled)
    remake = lambda c: gluon_descriptor(c, block_n)  # noqa: E731
    launch.derived = [(3, 1, remake), (4, 2, remake)]
    return launch


__all__ = ["GLUON", "eligible", "eligible_for", "launch_recorded", "launch_shared_gluon", "ticket_args"]
