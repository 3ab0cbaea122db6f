"""The grouping of a mixture-of-experts step's assignments by expert (``align``), on the GPU.

The N = T k assignments (each token's k experts) go into blocks of BM rows, each expert's run padded
to whole blocks, experts in order and each expert's assignments in token order (so a token's result
never depends on how the step was batched): ``slots`` [NB BM] (the assignment in each row),
``block_expert`` [NB] (-1: unused), ``block_rows`` [NB] (how many of the block's rows are real) and
``used`` [1] (the blocks in use, which the persistent expert kernels walk); NB = min(N, ceil(N / BM)
+ E) blocks bound every routing.

Fixed grids, no atomics (CUDA-graph safe). Up to ``EXPERT_PROGRAMS_MAX`` assignments, one launch
of a program an expert (``_group_kernel``): each histograms all the ids, so knows its first row, and
walks them in order for its own. Past that, two launches over chunks of the assignments: each chunk's
histogram of experts (``_count_kernel``), then each chunk placed (``_place_kernel``): from all the
chunks' histograms a program knows every expert's first row and how many of its assignments earlier
chunks hold; it sorts its own chunk by (expert, assignment), so each expert's assignments in the
chunk are consecutive and in order, and writes each to its row, and a slice of the block table.
Both give the same tables. docs/kernels.md §9 has the measured choices.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from prefixserve.model.kernels.moe_route import pow2
from prefixserve.triton_support import pdl, require_triton
from prefixserve.triton_support.pdl import launch_dependents, wait

triton, tl = require_triton()


@triton.jit
def _count_kernel(
    ids_ptr,  # [N] int32: each assignment's expert
    counts_ptr,  # [chunks, EP] int32 out: each chunk's histogram
    n_assign,
    EP: tl.constexpr,
    CHUNK: tl.constexpr,  # assignments a program
    PDL: tl.constexpr = False,  # launched as a dependent (``triton_support.pdl``)
):
    if PDL:
        launch_dependents()
        wait()
    c = tl.program_id(0)
    a = c * CHUNK + tl.arange(0, CHUNK)
    valid = a < n_assign
    hist = tl.histogram(tl.load(ids_ptr + a, mask=valid, other=0), EP, mask=valid)
    tl.store(counts_ptr + c * EP + tl.arange(0, EP), hist)


@triton.jit
def _place_kernel(
    ids_ptr,  # [N] int32
    counts_ptr,  # [chunks, EP] int32: ``_count_kernel``'s
    slots_ptr,  # [NB * BM] int32 out: the assignment in each row of each block
    block_expert_ptr,  # [NB] int32 out: each block's expert, -1 past the last used block
    block_rows_ptr,  # [NB] int32 out: real rows in each block
    used_ptr,  # [1] int32 out: the blocks in use (the first ``used``)
    n_assign,
    n_chunks,
    n_blocks,
    BM: tl.constexpr,
    EP: tl.constexpr,
    CHUNK: tl.constexpr,
    CP: tl.constexpr,  # chunks rounded up to a power of two
    BPP: tl.constexpr,  # block-table entries a program
    PDL: tl.constexpr = False,
):
    """Program c: chunk c's assignments into their rows, and entries [c BPP, (c + 1) BPP) of the block
    table; program 0 also ``used``."""
    if PDL:
        launch_dependents()
        wait()
    c = tl.program_id(0)
    lane = tl.arange(0, CHUNK)
    a = c * CHUNK + lane
    valid = a < n_assign
    ids = tl.load(ids_ptr + a, mask=valid, other=0)
    g = tl.arange(0, CP)
    experts = tl.arange(0, EP)
    table = tl.load(counts_ptr + g[:, None] * EP + experts[None, :], mask=g[:, None] < n_chunks, other=0)
    totals = tl.sum(table, 0)
    before = tl.sum(tl.where((g < c)[:, None], table, 0), 0)  # each expert's assignments in earlier chunks
    own = tl.sum(tl.where((g == c)[:, None], table, 0), 0)
    padded = (totals + BM - 1) // BM * BM
    ends = tl.cumsum(padded, 0)
    starts = ends - padded  # each expert's first row
    # the sorted chunk's j-th assignment, of expert e, goes to row base[e] + j
    base = starts + before - (tl.cumsum(own, 0) - own)
    keys = tl.sort(tl.where(valid, ids * CHUNK + lane, EP * CHUNK + lane))  # by (expert, assignment)
    expert = tl.minimum(keys // CHUNK, EP - 1)
    real = lane < tl.minimum(n_assign - c * CHUNK, CHUNK)
    tl.store(slots_ptr + tl.gather(base, expert, 0) + lane, c * CHUNK + keys % CHUNK, mask=real)
    # block b's owner: how many experts' runs end at or before it (E: past them all)
    first_block = c * BPP
    end_blocks = ends // BM - first_block
    ending = tl.histogram(end_blocks, BPP, mask=(end_blocks >= 0) & (end_blocks < BPP))
    owner = tl.sum((end_blocks < 0).to(tl.int32), 0) + tl.cumsum(ending, 0)
    inside = owner < EP
    owner = tl.minimum(owner, EP - 1)
    b = first_block + tl.arange(0, BPP)
    rows = tl.minimum(tl.gather(totals, owner, 0) - (b * BM - tl.gather(starts, owner, 0)), BM)
    tl.store(block_expert_ptr + b, tl.where(inside, owner, -1), mask=b < n_blocks)
    tl.store(block_rows_ptr + b, tl.where(inside, rows, 0), mask=b < n_blocks)
    if c == 0:
        tl.store(used_ptr, tl.sum(padded, 0) // BM)


@triton.jit
def _group_kernel(
    ids_ptr,  # [N] int32: each assignment's expert
    slots_ptr,  # [NB * BM] int32 out: the assignment in each row of each block
    block_expert_ptr,  # [NB] int32 out: each block's expert, -1 past the last used block
    block_rows_ptr,  # [NB] int32 out: real rows in each block
    used_ptr,  # [1] int32 out: the blocks in use (the first ``used``)
    n_assign,
    n_blocks,
    BM: tl.constexpr,
    EP: tl.constexpr,
    SPAN: tl.constexpr,  # N or more: every assignment in one load
    PDL: tl.constexpr = False,  # launched as a dependent (``triton_support.pdl``)
):
    """Program e: every expert's count (a histogram of all the ids), so its first row; then its own
    assignments in order into its rows, and its blocks' entries. Program 0 also marks the unused blocks."""
    if PDL:
        launch_dependents()
        wait()
    e = tl.program_id(0)
    experts = tl.arange(0, EP)
    a = tl.arange(0, SPAN)
    valid = a < n_assign
    ids = tl.load(ids_ptr + a, mask=valid, other=0)
    totals = tl.histogram(ids, EP, mask=valid)
    padded = (totals + BM - 1) // BM * BM
    start = tl.sum(tl.where(experts < e, padded, 0), 0)  # this expert's first row
    count = tl.sum(tl.where(experts == e, totals, 0), 0)
    hit = (ids == e) & valid
    tl.store(slots_ptr + start + tl.cumsum(hit.to(tl.int32), 0) - 1, a, mask=hit)
    i = tl.arange(0, BLOCK_SPAN)
    for r0 in range(0, count, BLOCK_SPAN * BM):
        b = r0 // BM + i  # this expert's b-th block
        ok = b * BM < count
        tl.store(block_expert_ptr + start // BM + b, e + b * 0, mask=ok)
        tl.store(block_rows_ptr + start // BM + b, tl.minimum(count - b * BM, BM), mask=ok)
    if e == 0:
        tl.store(used_ptr, tl.sum(padded, 0) // BM)
        for b0 in range(tl.sum(padded, 0) // BM, n_blocks, BLOCK_SPAN):
            b = b0 + i
            tl.store(block_expert_ptr + b, b * 0 - 1, mask=b < n_blocks)
            tl.store(block_rows_ptr + b, b * 0, mask=b < n_blocks)


BLOCK_SPAN = tl.constexpr(64)  # block entries a store in ``_group_kernel``
EXPERT_PROGRAMS_MAX = 1024  # up to this many assignments, ``_group_kernel`` (all in one load)
GROUP_CHUNK = 128  # assignments a program, at least (more where that would take more than MAX_CHUNKS)
MAX_CHUNKS = 64
GROUP_WARPS = 4


class Grouping(NamedTuple):
    """``align``'s tables (the module's docstring)."""

    slots: torch.Tensor
    block_expert: torch.Tensor
    block_rows: torch.Tensor
    used: torch.Tensor


def align(ids: torch.Tensor, experts: int, block_m: int) -> Grouping:
    """The flat assignments ``ids`` [N] grouped by expert: one or two launches (the module's docstring)."""
    n = ids.numel()
    blocks = min(n, triton.cdiv(n, block_m) + experts)
    device = ids.device
    slots = torch.empty(blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=device)
    block_rows = torch.empty(blocks, dtype=torch.int32, device=device)
    used = torch.empty(1, dtype=torch.int32, device=device)
    ep = pow2(experts)
    if n <= EXPERT_PROGRAMS_MAX:
        _group_kernel[(experts,)](
            ids, slots, block_expert, block_rows, used, n, blocks, BM=block_m, EP=ep,
            SPAN=EXPERT_PROGRAMS_MAX, num_warps=GROUP_WARPS, **pdl.chained(device),
        )  # fmt: skip
        return Grouping(slots, block_expert, block_rows, used)
    chunk = max(GROUP_CHUNK, pow2(triton.cdiv(n, MAX_CHUNKS)))
    chunks = triton.cdiv(n, chunk)
    launch = {"EP": ep, "CHUNK": chunk, "num_warps": GROUP_WARPS, **pdl.chained(device)}
    counts = torch.empty(chunks, ep, dtype=torch.int32, device=device)
    _count_kernel[(chunks,)](ids, counts, n, **launch)
    _place_kernel[(chunks,)](
        ids, counts, slots, block_expert, block_rows, used, n, chunks, blocks, BM=block_m, CP=pow2(chunks),
        BPP=pow2(triton.cdiv(blocks, chunks)), **launch,
    )  # fmt: skip
    return Grouping(slots, block_expert, block_rows, used)


__all__ = ["EXPERT_PROGRAMS_MAX", "GROUP_CHUNK", "GROUP_WARPS", "MAX_CHUNKS", "Grouping", "align"]
