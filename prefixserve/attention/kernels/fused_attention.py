"""One launch per layer: a step's shared-segment items and own-KV items in one persistent kernel.

Why: shared items are tensor-core bound (stacked rows against a long segment) and own items are
bandwidth bound (each sequence's own KV, read once). As two kernels they run one after the other on a
Hopper GPU, even on two streams: the shared kernel's 3-stage tiles take an SM's whole shared memory
and register file, so no own program fits beside one. Here one grid of resident programs takes work
from two queues: the first ``own_programs`` programs prefer own items, the rest shared items, and a
program whose queue is empty turns to the other. While the shared queue lasts, a slice of the SMs
streams own KV (few loaders, each with the whole SM's bandwidth share) while the rest keep the tensor
cores busy; whichever queue empties first, its programs help with the other, so the split only has
to be roughly right.

Both item kinds run the very code of the two kernels (``shared_program``, ``paged_program``) and
write the same partial slots, so the merge that follows is unchanged.

Tickets come from atomics on a small counter array: [shared taken, own taken, programs finished].
The last program to finish resets it, so a launch needs no memset and replays in a CUDA graph.
"""

from __future__ import annotations

import math

import torch

from prefixserve.attention.kernels import require_triton
from prefixserve.attention.kernels.launch import Launch
from prefixserve.attention.kernels.paged_attention import (
    LOG2E,
    check_cache,
    dot_precision,
    fit_tiles,
    interpreter_upcast,
    num_sms,
    paged_program,
    pick_block_m,
    smem_limit,
    tile_smem_bytes,
)
from prefixserve.attention.kernels.shared_attention import SharedWork, launch_with_descriptors, shared_program

triton, tl = require_triton()

COUNTERS = 3  # shared tickets taken, own tickets taken, programs finished
OWN_CHUNK = 4  # own programs per ticket: one atomic per few microseconds of streaming, not per item
OWN_BLOCK_N = 64


@triton.jit
def _fused_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    k_desc,
    v_desc,
    seg_blocks_ptr,
    seg_block_start_ptr,
    seg_rows_ptr,
    items_ptr,
    so_ptr,  # shared partial slots [slots, Hq, D] fp32
    slse_ptr,
    bt_ptr,  # own block tables [S, max_blocks] int32
    seq_lens_ptr,  # own lengths [S] int32
    qsl_ptr,  # [S+1] int32
    oo_ptr,  # own partials, split 0
    olse_ptr,
    counters_ptr,  # [COUNTERS] int32, zero between launches
    n_items,  # shared work items (each runs for every KV head)
    kv_heads,
    n_own,  # own programs: sequences x query tiles x KV heads x splits
    own_q_tiles,
    own_splits,
    own_split_size,
    own_programs,  # programs [0, own_programs) take own items first
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_sop,
    stride_soh,
    stride_slp,
    stride_bt,
    stride_oos,
    stride_oot,
    stride_ooh,
    stride_ols,
    stride_olt,
    GROUP: tl.constexpr,
    SH_BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    OWN_BLOCK_M: tl.constexpr,
    OWN_BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    USE_TMA: tl.constexpr,
    CHUNK: tl.constexpr,
):
    n_shared = n_items * kv_heads
    own_tickets = tl.cdiv(n_own, CHUNK)
    queue = tl.where(tl.program_id(0) < own_programs, 1, 0)  # 0: shared items, 1: own items
    empty = 0  # queues found empty so far
    while empty < 2:
        t = tl.atomic_add(counters_ptr + queue, 1)
        if queue == 0:
            if t < n_shared:  # item fastest, then KV head: programs in flight read one KV chunk
                shared_program(
                    t % n_items,
                    t // n_items,
                    q_ptr,
                    k_ptr,
                    v_ptr,
                    k_desc,
                    v_desc,
                    seg_blocks_ptr,
                    seg_block_start_ptr,
                    seg_rows_ptr,
                    items_ptr,
                    so_ptr,
                    slse_ptr,
                    qk_scale,
                    stride_qt,
                    stride_qh,
                    stride_kb,
                    stride_kt,
                    stride_kh,
                    stride_vb,
                    stride_vt,
                    stride_vh,
                    stride_sop,
                    stride_soh,
                    stride_slp,
                    GROUP,
                    SH_BLOCK_M,
                    BLOCK_N,
                    HEAD_DIM,
                    BLOCK_SIZE,
                    DOT_PREC,
                    UPCAST,
                    USE_TMA,
                    1,
                )
            else:
                queue = 1
                empty += 1
        else:
            if t < own_tickets:
                for j in tl.range(0, CHUNK, num_stages=1):
                    o = t * CHUNK + j
                    if o < n_own:
                        rest = o // own_splits
                        paged_program(
                            rest // kv_heads,
                            rest % kv_heads,
                            o % own_splits,
                            own_splits,
                            q_ptr,
                            k_ptr,
                            v_ptr,
                            bt_ptr,
                            seq_lens_ptr,
                            qsl_ptr,
                            oo_ptr,
                            olse_ptr,
                            qk_scale,
                            own_q_tiles,
                            own_split_size,
                            stride_qt,
                            stride_qh,
                            stride_kb,
                            stride_kt,
                            stride_kh,
                            stride_vb,
                            stride_vt,
                            stride_vh,
                            stride_bt,
                            stride_oos,
                            stride_oot,
                            stride_ooh,
                            stride_ols,
                            stride_olt,
                            GROUP,
                            OWN_BLOCK_M,
                            OWN_BLOCK_N,
                            HEAD_DIM,
                            BLOCK_SIZE,
                            DOT_PREC,
                            UPCAST,
                        )
            else:
                queue = 0
                empty += 1
    # every program has taken its last ticket once all have counted themselves out: reset for the next
    if tl.atomic_add(counters_ptr + 2, 1) == tl.num_programs(0) - 1:
        tl.atomic_xchg(counters_ptr, 0)
        tl.atomic_xchg(counters_ptr + 1, 0)
        tl.atomic_xchg(counters_ptr + 2, 0)


def fused_grid(device: torch.device, work: SharedWork, head_dim: int, elt: int) -> int:
    """Programs to launch: as many as can be resident at once (more would only wait for the queues)."""
    smem = tile_smem_bytes(work.block_m, work.block_n, head_dim, elt, work.num_stages) + 1024
    per_sm = 1 if work.block_m >= 128 else max(1, min(4, smem_limit(device) // smem))
    return num_sms(device) * per_sm


def own_share(shared_flops: float, own_bytes: float, programs: int) -> int:
    """Programs that take own items first: the own part's share of the step's time, by a roofline.

    Rates are the H200's measured ones (NOTES.md): tensor cores at ~480 TFLOP/s in the shared loop and
    ~4.2 TB/s copy bandwidth. A loose estimate is enough, since idle programs steal from the other queue.
    """
    if own_bytes <= 0:
        return 0
    t_shared = shared_flops / 480e12
    t_own = own_bytes / 4.2e12
    return max(1, min(programs - 1, round(programs * t_own / (t_own + t_shared))))


def launch_fused(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seg_blocks: torch.Tensor,
    seg_block_start: torch.Tensor,
    seg_rows: torch.Tensor,
    work: SharedWork,
    own_block_tables: torch.Tensor,
    own_seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    own_splits: int,
    own_split_size: int,
    o_part: torch.Tensor,  # [slots, Hq, D] fp32: shared slots first, then own splits x T rows
    lse_part: torch.Tensor,
    counters: torch.Tensor,  # [COUNTERS] int32 zeros, kept for the launch's lifetime
    own_programs: int | None = None,
    shared_row_tokens: int = 0,  # sum over segments of holder rows x tokens (the shared FLOPs)
    own_tokens: int = 0,  # KV tokens of all own parts (the own bytes)
) -> Launch | None:
    """Shared items and own items of one step in one launch; writes o_part / lse_part like the two
    separate kernels would (shared slots ``[0, work.num_slots)``, own split k of row t at
    ``work.num_slots + k * T + t``).

    Returns the recorded launch: args 0-2 are q, k_cache, v_cache (3-4 their TMA descriptors, remade
    from them on relaunch), so later layers replay it like the other launches.
    """
    q_heads, kv_heads, dim, block_size = check_cache(q, k_cache, v_cache)
    if counters.dtype != torch.int32 or counters.numel() < COUNTERS or counters.device != q.device:
        raise TypeError(f"counters must be {COUNTERS} int32 zeros on {q.device}")
    tokens = q.shape[0]
    num_seqs = own_seq_lens.shape[0]
    if tokens == 0 or (work.num_slots == 0 and num_seqs == 0):
        return None
    group = q_heads // kv_heads
    elt = q.element_size()
    own_m = pick_block_m(max_query_len * group, group)
    own_m, own_n, _ = fit_tiles(own_m, OWN_BLOCK_N, 2, dim, elt, smem_limit(q.device))
    q_tiles = math.ceil(max_query_len / (own_m // group))
    n_own = num_seqs * q_tiles * kv_heads * own_splits
    programs = fused_grid(q.device, work, dim, elt)
    if own_programs is None:
        flops = 4.0 * q_heads * dim * shared_row_tokens
        own_programs = own_share(flops, 2.0 * own_tokens * kv_heads * dim * elt, programs)
    ns = work.num_slots
    o_own, lse_own = o_part[ns:], lse_part[ns:]
    rest = (
        seg_blocks,
        seg_block_start,
        seg_rows,
        work.items,
        o_part,
        lse_part,
        own_block_tables,
        own_seq_lens,
        query_start_loc,
        o_own,
        lse_own,
        counters,
        int(work.items.shape[0]) if ns else 0,
        kv_heads,
        n_own,
        q_tiles,
        own_splits,
        own_split_size,
        own_programs,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        o_part.stride(0),
        o_part.stride(1),
        lse_part.stride(0),
        own_block_tables.stride(0),
        tokens * o_own.stride(0),
        o_own.stride(0),
        o_own.stride(1),
        tokens * lse_own.stride(0),
        lse_own.stride(0),
    )
    return launch_with_descriptors(
        _fused_kernel,
        (programs,),
        (q, k_cache, v_cache),
        rest,
        work.tma,
        GROUP=group,
        SH_BLOCK_M=work.block_m,
        BLOCK_N=work.block_n,
        OWN_BLOCK_M=own_m,
        OWN_BLOCK_N=own_n,
        HEAD_DIM=dim,
        BLOCK_SIZE=block_size,
        DOT_PREC=dot_precision(q.dtype),
        UPCAST=interpreter_upcast(q.dtype),
        CHUNK=OWN_CHUNK,
        num_warps=8 if work.block_m >= 128 else 4,
        num_stages=work.num_stages,
    )


__all__ = ["COUNTERS", "launch_fused"]
