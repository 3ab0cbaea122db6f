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

import torch

from prefixserve.attention.kernels.gluon_attend import GL_DTYPES, GLUON, LOG2E, gluon_descriptor
from prefixserve.triton_support.launch import Launch, record

if GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

    from prefixserve.attention.kernels.gluon_attend import (
        _fp8_query,
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
            v_stage,
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
        KV_FP8: gl.constexpr = k_bufs.dtype == gl.float8e4nv
        if KV_FP8:  # this warpgroup's own fp16 tile that each e4m3 V tile is widened into
            ring = (k_bufs, v_bufs, k_ready, v_ready, kv_empty, v_stage.index(m_off // PART_M))
        else:
            ring = (k_bufs, v_bufs, k_ready, v_ready, kv_empty, v_bufs)
        c = 0
        for t in range(first, end, step):
            base, row_lo, row_hi, kv_len, n_tiles = _item_range(items_ptr, t, num_items, BLOCK_N)
            kvh = t // num_items
            q_rows = (q_ptr, seg_rows_ptr, row_lo, row_hi, kvh, stride_qt, stride_qh)
            q = _ticket_query(q_rows, m_off, GROUP, BLOCK_M, PART_M, HEAD_DIM, ld)
            if KV_FP8:  # e4m3 rows, a scale each, for Q K^T on FP8 tensor cores
                q, qk = _fp8_query(q, qk_scale)
            else:
                qk = qk_scale
            q_part.store(q)
            fence_async_shared()  # generic stores before the wgmma's async reads
            ticket = (base, row_lo, row_hi, kv_len, n_tiles, kvh)
            out = (o_ptr, lse_ptr, stride_op, stride_oh, stride_lp)
            _run_ticket(q_part, ring, c, ticket, out, qk, m_off, GROUP, BLOCK_M, BLOCK_N, HEAD_DIM, OVERLAP)
            c += n_tiles

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
    ):
        # a Gluon kernel body: shared memory, barriers and the partitions' wiring, kept in one piece
        """Grid (work items, KV heads): one ticket (item, head) per program. A ticket's rows x GROUP
        heads attend its KV range and land in its partial slots."""
        first = gl.program_id(0) + gl.program_id(1) * num_items
        end, step = first + 1, 1
        # shared-memory shapes are powers of two: 192 query rows sit in a 256-row buffer
        Q_ROWS: gl.constexpr = 256 if BLOCK_M == 192 else BLOCK_M
        PART_M: gl.constexpr = 64  # rows of each consumer warpgroup: one wgmma's M
        k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)  # noqa: RUF005
        v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)  # noqa: RUF005
        if k_desc.dtype == gl.float8e4nv:
            # an e4m3 cache: q as e4m3 codes (Q K^T on FP8 tensor cores), and a V stage of fp16 per
            # consumer warpgroup (``gluon_attend._attend_tiles``)
            q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([Q_ROWS, HEAD_DIM], gl.float8e4nv)
            q_smem = gl.allocate_shared_memory(gl.float8e4nv, [Q_ROWS, HEAD_DIM], q_layout)
            stage_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], gl.float16)
            stages: gl.constexpr = [BLOCK_M // PART_M, BLOCK_N, HEAD_DIM]
            v_stage = gl.allocate_shared_memory(gl.float16, stages, stage_layout)
        else:
            q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(
                [Q_ROWS, HEAD_DIM], q_ptr.dtype.element_ty
            )
            q_smem = gl.allocate_shared_memory(q_ptr.dtype.element_ty, [Q_ROWS, HEAD_DIM], q_layout)
            v_stage = v_bufs
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=BLOCK_M // PART_M)  # every consumer frees the slot
        fence_async_shared()  # the barrier inits before any async use
        # two (or, on 192-row tiles, three) consumer warpgroups, each its own partition (one's softmax
        # beside the others' products), and the loader warp
        # what both consumer partitions read (worker partitions take scalars and shared memory only)
        shared = (
            q_smem,
            k_bufs,
            v_bufs,
            v_stage,
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
        loads = (
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
            BLOCK_N,
            HEAD_DIM,
            STAGES,
        )
        if BLOCK_M == 3 * PART_M:
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
    dtype or e4m3 (an FP8 KV cache) and contiguous (descriptors), 128- or 192-row tiles (two or three
    64-row consumer warpgroups)."""
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
    configuration (docs/kernels.md §2.3).
    """
    q_heads, dim = q.shape[1:]
    kv_heads = k_cache.shape[2]
    args = (
        q,
        k_cache,
        v_cache,
        gluon_descriptor(k_cache, block_n),
        gluon_descriptor(v_cache, block_n),
        seg_rows,
        items,
        o_part,
        lse_part,
        scale * LOG2E,
        items.shape[0],
        kv_heads,
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
        STAGES=stages,
        OVERLAP=block_m == 128,
        CONSUMER_REGS=CONSUMER_REGS[block_m],
        num_warps=4,  # the default partition: one consumer warpgroup
        maxnreg=MAXNREG if block_m == 128 else MAXNREG_WIDE,
    )
    grid = (items.shape[0], kv_heads)
    compiled = shared_gluon_kernel[grid](*args, **kw)
    launch = record(shared_gluon_kernel, grid, args, kw, compiled)
    remake = lambda c: gluon_descriptor(c, block_n)  # noqa: E731
    launch.derived = [(3, 1, remake), (4, 2, remake)]
    return launch


__all__ = ["GLUON", "eligible", "eligible_for", "launch_shared_gluon"]
