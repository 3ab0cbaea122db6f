"""The grouping of a mixture-of-experts step's assignments by expert (``align``), on the GPU.

The N = T k assignments (each token's k experts) go into blocks of BM rows, each expert's run padded
to whole blocks, experts in order and each expert's assignments in token order (so a token's result
never depends on how the step was batched): ``slots`` [NB BM] (the assignment in each row),
``block_expert`` [NB] (-1: unused), ``block_rows`` [NB] (how many of the block's rows are real) and
``used`` [1] (the blocks in use, which the persistent expert kernels walk); NB = min(N, ceil(N / BM)
+ E) blocks bound every routing. One launch, a program an expert, a fixed grid: CUDA-graph safe.
docs/kernels.md §9 has the measured choices.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from prefixserve.model.kernels.moe_route import pow2
from prefixserve.triton_support import pdl, require_triton
from prefixserve.triton_support.pdl import launch_dependents, wait

triton, tl = require_triton()


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
    SPAN: tl.constexpr,  # assignments a pass
    PDL: tl.constexpr = False,  # launched as a dependent (``triton_support.pdl``)
):
    """Program e: every expert's count (a histogram of all the ids), so its first row; then its own
    assignments in order into its rows, and its blocks' entries. Program 0 also marks the unused blocks."""
    if PDL:
        launch_dependents()
        wait()
    e = tl.program_id(0)
    experts = tl.arange(0, EP)
    lane = tl.arange(0, SPAN)
    totals = tl.zeros([EP], dtype=tl.int32)
    for c in range(0, n_assign, SPAN):
        a = c + lane
        valid = a < n_assign
        totals += tl.histogram(tl.load(ids_ptr + a, mask=valid, other=0), EP, mask=valid)
    padded = (totals + BM - 1) // BM * BM
    start = tl.sum(tl.where(experts < e, padded, 0), 0)  # this expert's first row
    count = tl.sum(tl.where(experts == e, totals, 0), 0)
    running = start
    for c in range(0, n_assign, SPAN):
        a = c + lane
        hit = tl.load(ids_ptr + a, mask=a < n_assign, other=-1) == e
        tl.store(slots_ptr + running + tl.cumsum(hit.to(tl.int32), 0) - 1, a, mask=hit)
        running += tl.sum(hit.to(tl.int32), 0)
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
GROUP_SPANS = (1024, 8192)  # the grouping's assignments a pass: at least, at most (more: several passes)
GROUP_WARPS = 4


class Grouping(NamedTuple):
    """``align``'s tables (the module's docstring)."""

    slots: torch.Tensor
    block_expert: torch.Tensor
    block_rows: torch.Tensor
    used: torch.Tensor


def align(ids: torch.Tensor, experts: int, block_m: int) -> Grouping:
    """The flat assignments ``ids`` [N] grouped by expert: one launch, a program an expert."""
    n = ids.numel()
    blocks = min(n, triton.cdiv(n, block_m) + experts)
    slots = torch.empty(blocks * block_m, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=ids.device)
    block_rows = torch.empty(blocks, dtype=torch.int32, device=ids.device)
    used = torch.empty(1, dtype=torch.int32, device=ids.device)
    span = min(max(pow2(n), GROUP_SPANS[0]), GROUP_SPANS[1])
    _group_kernel[(experts,)](
        ids, slots, block_expert, block_rows, used, n, blocks, BM=block_m, EP=pow2(experts), SPAN=span,
        num_warps=GROUP_WARPS, **pdl.chained(ids.device),
    )  # fmt: skip
    return Grouping(slots, block_expert, block_rows, used)


__all__ = ["GROUP_SPANS", "GROUP_WARPS", "Grouping", "align"]
