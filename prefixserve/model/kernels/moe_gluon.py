"""Warp-specialised persistent expert GEMMs for Hopper (Gluon): the fused MoE's 64-row blocks.

``fused_moe``'s persistent Triton kernels walk the used blocks' column tiles, each program running a
tile's K loop between its prologue and its epilogue; at 64 tokens an expert the grouped GEMMs reach
only about 0.8 (up) and 0.7 (down) of their weights' copy rate (docs/kernels.md §9). Here a program an
SM splits the work the way the shared attention kernel does (``attention/kernels/shared_gluon.py``):

  * a loader partition walks the program's tiles and streams each K step's operands into a ring of
    shared-memory slots, across tile boundaries: the weights' rows by TMA, and (up) the block's
    tokens gathered from x by ``cp.async`` (Hopper's TMA cannot gather rows), or (down) the block's
    rows of ``inter`` by TMA;
  * two consumer warpgroups take the program's tiles in turn (even, odd), each from a ring of its
    own; the loader interleaves a pair of tiles' K steps, so both consumers' products run at once and
    one's epilogue (the activation, or the routing weight and the scattered store) runs beside the
    other's products.

The tiles, their order, the K step and every product are those of the Triton kernels (the tiles of a
block's columns one after another, K in ``BK`` steps), so the sums and the outputs are the same bits
(tested against them on the GPU). ``eligible`` says when the launch can take them.
"""

from __future__ import annotations

import torch

from prefixserve.attention.kernels.gluon_attend import GL_DTYPES, GLUON
from prefixserve.attention.planning.tiles import num_sms

if GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        async_copy,
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from prefixserve.triton_support.pdl import wait

ENABLED = True  # a module switch (probes and tests compare with the Triton kernels)
BM = 64  # block rows: one consumer warpgroup's wgmma M
BK = 64  # the K step, as the Triton kernels' 64-row tile
BN_UP = 64  # the up kernel's intermediate columns a tile (two accumulators: gate and up)
BN_DOWN = 128  # the down kernel's hidden columns a tile
STAGES = 8  # slots, two rings of four (one a consumer): 24 KB each at these tiles
LOADER_WARPS_UP = 4  # the up kernel's loader: a warpgroup issues the gathered rows' cp.async
MAXNREG = 168  # registers a thread at launch: maxnreg x 12 warps x 32 threads <= 65,536
CONSUMER_REGS = 224
LOADER_REGS = 56


def eligible(x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, block_m: int) -> bool:
    """True when these kernels can run the grouped GEMMs: switched on, a Hopper GPU with Gluon, 16-bit
    weights and activations, 64-row blocks, the shapes whole tiles (TMA boxes never straddle two
    experts' rows) and the weights contiguous (descriptors)."""
    if not (ENABLED and GLUON and x.is_cuda and block_m == BM and x.dtype in GL_DTYPES):
        return False
    if torch.cuda.get_device_capability(x.device)[0] != 9:
        return False
    hidden, inter = x.shape[1], w_down.shape[1]
    return (
        w_up.dtype == w_down.dtype == x.dtype
        and hidden % BK == 0
        and hidden % BN_DOWN == 0
        and inter % BK == 0
        and inter % BN_UP == 0
        and w_up.is_contiguous()
        and w_down.is_contiguous()
        and x.stride(1) == 1
        and x.stride(0) % 16 == 0  # the gathered rows' cp.async copies 16 bytes at a time
        and x.data_ptr() % 16 == 0
    )


def _descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    layout = gl.NVMMASharedLayout.get_default_for([rows, BK], GL_DTYPES[t.dtype])
    return TensorDescriptor.from_tensor(t, [rows, BK], layout)


if GLUON:

    @gluon.jit
    def _act(gate, up, dtype: gl.constexpr, ACTIVATION: gl.constexpr, alpha, limit):
        """``fused_moe._act`` (and ``silu_mul.silu_mul``) in Gluon: the same operations in the same
        order, so the same bits."""
        if ACTIVATION == 2:  # gpt-oss: (clamp(up) + 1) * g * sigmoid(alpha g), g = min(gate, limit)
            g = gl.minimum(gate.to(dtype).to(gl.float32), limit)
            u = gl.minimum(gl.maximum(up.to(dtype).to(gl.float32), -limit), limit)
            return (u + 1.0) * (g / (1.0 + gl.exp(-alpha * g)))
        gate = gate.to(dtype).to(gl.float32)
        up = up.to(dtype).to(gl.float32)
        if ACTIVATION == 1:  # the tanh GELU: x sigmoid(2u), u = sqrt(2 / pi) (x + 0.044715 x^3)
            u = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
            act = (gate / (1.0 + gl.exp(-2.0 * u))).to(dtype).to(gl.float32)
        else:
            act = (gate / (1.0 + gl.exp(-gate))).to(dtype).to(gl.float32)
        return act * up

    @gluon.jit
    def _slot(ring, c, HALF: gl.constexpr):
        """(slot, phase) of the c-th load through consumer ``ring``'s half of the slots. Each consumer
        has a ring of its own: a phase wait tells only the last two phases apart, and a consumer that
        skips the other's tiles would run phases ahead of a shared ring's barriers."""
        return ring * HALF + c % HALF, (c // HALF) & 1

    @gluon.jit
    def _block_rows(block, slots_ptr, block_rows_ptr, BM: gl.constexpr, layout: gl.constexpr):
        """(which of the block's BM rows are real, their assignments), in ``layout``."""
        r = gl.arange(0, BM, layout=layout)
        real = r < gl.load(block_rows_ptr + block)
        return real, gl.load(slots_ptr + block * BM + r, mask=real, other=0)

    @gluon.jit
    def _up_rows(tile, cols, x_ptr, stride_x, slots_ptr, block_expert_ptr, block_rows_ptr, inter,
                 TOP_K: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, ld: gl.constexpr):  # fmt: skip
        """A tile's gathered x rows (pointers, real) and its expert's first gate row."""
        block = tile // cols
        real, assign = _block_rows(block, slots_ptr, block_rows_ptr, BM, gl.SliceLayout(1, ld))
        rows = x_ptr + gl.expand_dims((assign // TOP_K).to(gl.int64) * stride_x, 1)
        return (
            rows,
            gl.expand_dims(real, 1),
            gl.load(block_expert_ptr + block) * 2 * inter + (tile % cols) * BN,
        )

    @gluon.jit
    def _up_step(ring, c, k, tile_rows, inter, w_desc, x_bufs, g_bufs, u_bufs, x_ready, w_ready, empty,
                 ld: gl.constexpr):  # fmt: skip
        """One K step of a tile into slot ``_slot(ring, c)``: gate and up rows by TMA, x's rows by
        cp.async (each loader thread's copies arrive on ``x_ready`` when they land)."""
        rows, real, gate_row = tile_rows
        BK: gl.constexpr = x_bufs.shape[2]
        s, phase = _slot(ring, c, x_bufs.shape[0] // 2)
        mbarrier.wait(empty.index(s), phase ^ 1)  # a fresh barrier passes phase 1
        mbarrier.expect(w_ready.index(s), 2 * w_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(w_desc, [gate_row, k * BK], w_ready.index(s), g_bufs.index(s))
        tma.async_copy_global_to_shared(w_desc, [gate_row + inter, k * BK], w_ready.index(s), u_bufs.index(s))
        k_cols = gl.expand_dims(gl.arange(0, BK, layout=gl.SliceLayout(0, ld)), 0)
        async_copy.async_copy_global_to_shared(x_bufs.index(s), rows + k * BK + k_cols, mask=real)
        async_copy.mbarrier_arrive(x_ready.index(s), increment_count=False)

    @gluon.jit
    def _up_loader(loads, PROGRAMS: gl.constexpr, TOP_K: gl.constexpr):
        """The program's tiles in pairs, the pair's K steps interleaved: tile 2p to the first
        consumer's ring, 2p + 1 to the second's, so both consumers' products run at once.
        (Constexprs reach a partition as its own arguments: inside a tuple they turn into values.)"""
        x_ptr, stride_x, w_desc, x_bufs, g_bufs, u_bufs, x_ready, w_ready, empty, slots_ptr = loads[:10]
        block_expert_ptr, block_rows_ptr, used_ptr, inter = loads[10:]
        BM: gl.constexpr = x_bufs.shape[1]
        BK: gl.constexpr = x_bufs.shape[2]
        BN: gl.constexpr = g_bufs.shape[1]
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BK, BK // 8], [gl.num_warps(), 1], [1, 0])
        cols = inter // BN
        steps = w_desc.shape[1] // BK
        total = gl.load(used_ptr) * cols
        ring = (w_desc, x_bufs, g_bufs, u_bufs, x_ready, w_ready, empty)
        gather = (x_ptr, stride_x, slots_ptr, block_expert_ptr, block_rows_ptr, inter)
        for first in range(gl.program_id(0), total, 2 * PROGRAMS):
            second = first + PROGRAMS
            rows_a = _up_rows(first, cols, *gather, TOP_K, BM, BN, ld)
            rows_b = _up_rows(gl.minimum(second, total - 1), cols, *gather, TOP_K, BM, BN, ld)
            c0 = (first - gl.program_id(0)) // (2 * PROGRAMS) * steps
            for k in range(steps):
                _up_step(0, c0 + k, k, rows_a, inter, *ring, ld)
                if second < total:
                    _up_step(1, c0 + k, k, rows_b, inter, *ring, ld)

    @gluon.jit
    def _up_consumer(which, shared, PROGRAMS: gl.constexpr, ACTIVATION: gl.constexpr, HAS_BIAS: gl.constexpr):
        """Tiles ``which``, which + 2, ... of the program: gate and up products over the ring, the
        activation, the block's real rows of ``inter``."""
        x_bufs, g_bufs, u_bufs, x_ready, w_ready, empty, bias_ptr, inter_ptr = shared[:8]
        block_expert_ptr, block_rows_ptr, used_ptr, inter, hidden, alpha, limit = shared[8:]
        BM: gl.constexpr = x_bufs.shape[1]
        BN: gl.constexpr = g_bufs.shape[1]
        BK: gl.constexpr = x_bufs.shape[2]
        HALF: gl.constexpr = x_bufs.shape[0] // 2
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, BN, 16]
        )
        dtype: gl.constexpr = inter_ptr.dtype.element_ty
        cols = inter // BN
        steps = hidden // BK
        zero = gl.zeros([BM, BN], gl.float32, layout=acc_layout)
        for tile in range(gl.program_id(0) + which * PROGRAMS, gl.load(used_ptr) * cols, 2 * PROGRAMS):
            t = (tile - gl.program_id(0)) // (2 * PROGRAMS)  # this consumer's t-th tile
            acc_g = zero
            acc_u = zero
            for k in range(steps):
                s, phase = _slot(which, t * steps + k, HALF)
                mbarrier.wait(x_ready.index(s), phase)
                mbarrier.wait(w_ready.index(s), phase)
                fence_async_shared()  # the gathered rows (cp.async: generic proxy) before wgmma reads them
                acc_g = warpgroup_mma(x_bufs.index(s), g_bufs.index(s).permute((1, 0)), acc_g, is_async=True)
                acc_u = warpgroup_mma(x_bufs.index(s), u_bufs.index(s).permute((1, 0)), acc_u, is_async=True)
                acc_g, acc_u = warpgroup_mma_wait(2, deps=(acc_g, acc_u))  # the step before's pair is done
                if k > 0:
                    mbarrier.arrive(empty.index(_slot(which, t * steps + k - 1, HALF)[0]), count=1)
            acc_g, acc_u = warpgroup_mma_wait(0, deps=(acc_g, acc_u))
            mbarrier.arrive(empty.index(_slot(which, t * steps + steps - 1, HALF)[0]), count=1)
            block = tile // cols
            n = (tile % cols) * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, acc_layout))
            if HAS_BIAS:
                bias_cols = gl.load(block_expert_ptr + block).to(gl.int64) * 2 * inter + n
                acc_g += gl.expand_dims(gl.load(bias_ptr + bias_cols).to(gl.float32), 0)
                acc_u += gl.expand_dims(gl.load(bias_ptr + bias_cols + inter).to(gl.float32), 0)
            out = _act(acc_g, acc_u, dtype, ACTIVATION, alpha, limit)
            r = gl.arange(0, BM, layout=gl.SliceLayout(1, acc_layout))
            real = r < gl.load(block_rows_ptr + block)
            row = block.to(gl.int64) * BM + r
            ptrs = inter_ptr + gl.expand_dims(row * inter, 1) + gl.expand_dims(n, 0)
            gl.store(ptrs, out.to(dtype), mask=gl.expand_dims(real, 1))

    @gluon.jit
    def expert_up_kernel(
        x_ptr, w_desc, bias_ptr, inter_ptr, slots_ptr, block_expert_ptr, block_rows_ptr, used_ptr,
        stride_x, inter, hidden, alpha, limit,
        TOP_K: gl.constexpr, PROGRAMS: gl.constexpr, ACTIVATION: gl.constexpr, HAS_BIAS: gl.constexpr,
        BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
        LOADER_WARPS: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
        PDL: gl.constexpr = False,
    ):  # fmt: skip
        # a Gluon kernel body: shared memory, barriers and the partitions' wiring, kept in one piece
        """``fused_moe._persistent_up_kernel``'s tiles: a program an SM, a loader and two consumers."""
        if PDL:
            wait()
        dtype: gl.constexpr = x_ptr.dtype.element_ty
        x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BK], dtype)
        x_bufs = gl.allocate_shared_memory(dtype, [STAGES, BM, BK], x_layout)
        g_bufs = gl.allocate_shared_memory(dtype, [STAGES, BN, BK], w_desc.layout)
        u_bufs = gl.allocate_shared_memory(dtype, [STAGES, BN, BK], w_desc.layout)
        x_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        w_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(x_ready.index(s), count=32 * LOADER_WARPS)  # each loader thread's copies
            mbarrier.init(w_ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=1)  # the one consumer of the slot frees it
        fence_async_shared()  # the barrier inits before any async use
        shared = (x_bufs, g_bufs, u_bufs, x_ready, w_ready, empty, bias_ptr, inter_ptr)
        shared += (block_expert_ptr, block_rows_ptr, used_ptr, inter, hidden, alpha, limit)
        loads = (x_ptr, stride_x, w_desc, x_bufs, g_bufs, u_bufs, x_ready, w_ready, empty, slots_ptr)
        loads += (block_expert_ptr, block_rows_ptr, used_ptr, inter)
        gl.warp_specialize(
            [
                (_up_consumer, (0, shared, PROGRAMS, ACTIVATION, HAS_BIAS)),
                (_up_consumer, (1, shared, PROGRAMS, ACTIVATION, HAS_BIAS)),
                (_up_loader, (loads, PROGRAMS, TOP_K)),
            ],
            [4, LOADER_WARPS],
            [CONSUMER_REGS, LOADER_REGS],
        )

    @gluon.jit
    def _down_step(ring, c, k, block, w_row, a_desc, w_desc, a_bufs, w_bufs, ready, empty):
        """One K step of a tile into slot ``_slot(ring, c)`` by TMA: the block's rows of ``inter`` and
        the expert's down rows of the tile's hidden columns."""
        BM: gl.constexpr = a_bufs.shape[1]
        BK: gl.constexpr = a_bufs.shape[2]
        s, phase = _slot(ring, c, a_bufs.shape[0] // 2)
        mbarrier.wait(empty.index(s), phase ^ 1)
        mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + w_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, [block * BM, k * BK], ready.index(s), a_bufs.index(s))
        tma.async_copy_global_to_shared(w_desc, [w_row, k * BK], ready.index(s), w_bufs.index(s))

    @gluon.jit
    def _down_loader(loads, PROGRAMS: gl.constexpr):
        """The program's tiles in pairs, the pair's K steps interleaved (as ``_up_loader``)."""
        a_desc, w_desc, a_bufs, w_bufs, ready, empty, block_expert_ptr, used_ptr, hidden = loads
        BK: gl.constexpr = a_bufs.shape[2]
        BN: gl.constexpr = w_bufs.shape[1]
        cols = hidden // BN
        steps = a_desc.shape[1] // BK
        total = gl.load(used_ptr) * cols
        ring = (a_desc, w_desc, a_bufs, w_bufs, ready, empty)
        for first in range(gl.program_id(0), total, 2 * PROGRAMS):
            second = gl.minimum(first + PROGRAMS, total - 1)
            block_a = first // cols
            block_b = second // cols
            w_row_a = gl.load(block_expert_ptr + block_a) * hidden + (first % cols) * BN
            w_row_b = gl.load(block_expert_ptr + block_b) * hidden + (second % cols) * BN
            c0 = (first - gl.program_id(0)) // (2 * PROGRAMS) * steps
            for k in range(steps):
                _down_step(0, c0 + k, k, block_a, w_row_a, *ring)
                if first + PROGRAMS < total:
                    _down_step(1, c0 + k, k, block_b, w_row_b, *ring)

    @gluon.jit
    def _down_consumer(which, shared, PROGRAMS: gl.constexpr, HAS_BIAS: gl.constexpr):
        """Tiles ``which``, which + 2, ... of the program: the product over the ring, the expert's
        output rounded to the model dtype, times the routing weight, written by assignment."""
        a_bufs, w_bufs, ready, empty, bias_ptr, weights_ptr, out_ptr, slots_ptr = shared[:8]
        block_expert_ptr, block_rows_ptr, used_ptr, hidden, inter = shared[8:]
        BM: gl.constexpr = a_bufs.shape[1]
        BN: gl.constexpr = w_bufs.shape[1]
        BK: gl.constexpr = a_bufs.shape[2]
        HALF: gl.constexpr = a_bufs.shape[0] // 2
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, BN, 16]
        )
        dtype: gl.constexpr = out_ptr.dtype.element_ty
        cols = hidden // BN
        steps = inter // BK
        zero = gl.zeros([BM, BN], gl.float32, layout=acc_layout)
        for tile in range(gl.program_id(0) + which * PROGRAMS, gl.load(used_ptr) * cols, 2 * PROGRAMS):
            t = (tile - gl.program_id(0)) // (2 * PROGRAMS)
            acc = zero
            for k in range(steps):
                s, phase = _slot(which, t * steps + k, HALF)
                mbarrier.wait(ready.index(s), phase)
                acc = warpgroup_mma(a_bufs.index(s), w_bufs.index(s).permute((1, 0)), acc, is_async=True)
                acc = warpgroup_mma_wait(1, deps=(acc,))  # the step before's product is done
                if k > 0:
                    mbarrier.arrive(empty.index(_slot(which, t * steps + k - 1, HALF)[0]), count=1)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(empty.index(_slot(which, t * steps + steps - 1, HALF)[0]), count=1)
            block = tile // cols
            n = (tile % cols) * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, acc_layout))
            if HAS_BIAS:
                expert = gl.load(block_expert_ptr + block).to(gl.int64)
                acc += gl.expand_dims(gl.load(bias_ptr + expert * hidden + n).to(gl.float32), 0)
            acc = acc.to(dtype).to(gl.float32)  # the expert's output in the model dtype
            real, assign = _block_rows(block, slots_ptr, block_rows_ptr, BM, gl.SliceLayout(1, acc_layout))
            assign = assign.to(gl.int64)
            weight = gl.load(weights_ptr + assign, mask=real, other=0.0)
            out = acc * gl.expand_dims(weight, 1)
            ptrs = out_ptr + gl.expand_dims(assign * hidden, 1) + gl.expand_dims(n, 0)
            gl.store(ptrs, out.to(dtype), mask=gl.expand_dims(real, 1))

    @gluon.jit
    def expert_down_kernel(
        a_desc, w_desc, bias_ptr, weights_ptr, out_ptr, slots_ptr, block_expert_ptr, block_rows_ptr, used_ptr,
        hidden, inter,
        PROGRAMS: gl.constexpr, HAS_BIAS: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
        STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
        PDL: gl.constexpr = False,
    ):  # fmt: skip
        # a Gluon kernel body: shared memory, barriers and the partitions' wiring, kept in one piece
        """``fused_moe._persistent_down_kernel``'s tiles: a program an SM, a loader and two consumers."""
        if PDL:
            wait()
        dtype: gl.constexpr = out_ptr.dtype.element_ty
        a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BM, BK], a_desc.layout)
        w_bufs = gl.allocate_shared_memory(dtype, [STAGES, BN, BK], w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=1)
        fence_async_shared()
        shared = (a_bufs, w_bufs, ready, empty, bias_ptr, weights_ptr, out_ptr, slots_ptr, block_expert_ptr)
        shared += (block_rows_ptr, used_ptr, hidden, inter)
        loads = (a_desc, w_desc, a_bufs, w_bufs, ready, empty, block_expert_ptr, used_ptr, hidden)
        gl.warp_specialize(
            [
                (_down_consumer, (0, shared, PROGRAMS, HAS_BIAS)),
                (_down_consumer, (1, shared, PROGRAMS, HAS_BIAS)),
                (_down_loader, (loads, PROGRAMS)),
            ],
            [4, 1],
            [CONSUMER_REGS, LOADER_REGS],
        )


def expert_up(
    x: torch.Tensor, w_up: torch.Tensor, bias: torch.Tensor | None, inter_out: torch.Tensor,
    grouping: tuple[torch.Tensor, ...], top_k: int, activation: int, alpha: float, limit: float, pdl: bool,
) -> None:  # fmt: skip
    """The up GEMM of the used 64-row blocks into ``inter_out`` (``grouping``: ``moe_grouping.align``'s
    slots, block_expert, block_rows, used)."""
    slots, block_expert, block_rows, used = grouping
    inter = inter_out.shape[1]
    programs = num_sms(x.device)
    expert_up_kernel[(programs,)](
        x, _descriptor(w_up, BN_UP), bias if bias is not None else w_up, inter_out, slots, block_expert,
        block_rows, used, x.stride(0), inter, x.shape[1], alpha, limit,
        TOP_K=top_k, PROGRAMS=programs, ACTIVATION=activation, HAS_BIAS=bias is not None, BM=BM, BN=BN_UP,
        BK=BK, STAGES=STAGES, LOADER_WARPS=LOADER_WARPS_UP, CONSUMER_REGS=CONSUMER_REGS,
        LOADER_REGS=LOADER_REGS, PDL=pdl, num_warps=4, maxnreg=MAXNREG,
        **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip


def expert_down(
    inter_out: torch.Tensor, w_down: torch.Tensor, bias: torch.Tensor | None, weights: torch.Tensor,
    parts: torch.Tensor, grouping: tuple[torch.Tensor, ...], pdl: bool,
) -> None:  # fmt: skip
    """The down GEMM of the used 64-row blocks, weighted, into ``parts`` [N, H] by assignment."""
    slots, block_expert, block_rows, used = grouping
    hidden, inter = parts.shape[1], inter_out.shape[1]
    programs = num_sms(parts.device)
    expert_down_kernel[(programs,)](
        _descriptor(inter_out, BM), _descriptor(w_down, BN_DOWN), bias if bias is not None else w_down,
        weights, parts, slots, block_expert, block_rows, used, hidden, inter,
        PROGRAMS=programs, HAS_BIAS=bias is not None, BM=BM, BN=BN_DOWN, BK=BK, STAGES=STAGES,
        CONSUMER_REGS=CONSUMER_REGS, LOADER_REGS=24, PDL=pdl, num_warps=4, maxnreg=MAXNREG,
        **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip


__all__ = ["BM", "ENABLED", "eligible", "expert_down", "expert_up"]
