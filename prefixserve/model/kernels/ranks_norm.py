"""More than two ranks' row-parallel products summed over NVLink, the residual added and RMSNorm applied.

``peer_norm.py`` does this for two ranks; past two, PyTorch's two-shot all-reduce then ``add_rms_norm``
is two kernels and their gap per call. Here every rank maps every rank's product slot
(``peer_allreduce._FusedSlots``: a table of addresses, this rank's own among them), and one kernel
meets the other ranks once, reads each of its rows from every rank's product ((N - 1) whole products
a rank over NVLink: one-shot), sums, adds the residual and normalises. It pays for a few rows, where
a call is its meetings' latency; above ``peer_allreduce.RANKS_MAX_ROWS`` the two-shot's fewer bytes
win and the engine takes that path (docs/kernels.md §8 has both measured, and a fused two-shot that
lost to PyTorch's).

Every rank sums the ranks' products in rank order in fp32 and rounds once, so every rank's residual
stream is the same bit for bit.

Meetings go by call count as at two ranks: program ``i`` raises its own count (one atomic a call),
writes it into every other rank's flag ``[rank, i]`` without waiting for an answer and reads its own
flags ``[q, i]`` (acquire) until every other rank ``q`` has reached it. The products are the kernels'
before this one, complete before it began, so the counts go out relaxed. Consecutive calls use
different slots (``peer_allreduce``), which with one meeting a call makes reuse safe for the reason
``peer_norm.py`` gives. A raised abort flag ends every wait (``wait_for_count``).
"""

from __future__ import annotations

import torch

from prefixserve.model.kernels.peer_norm import MAX_HIDDEN, MAX_PROGRAMS, add_norm_store, wait_for_count
from prefixserve.triton_support import require_triton
from prefixserve.triton_support.bound import BoundKernel

triton, tl = require_triton()

MAX_RANKS = 8  # one host's NVLink domain
COUNTS_ROW: tl.constexpr = tl.constexpr(MAX_PROGRAMS)  # a rank's row of the counts (a jit global)


@triton.jit
def _meet(my_counts_ptr, counts_table_ptr, call, pid, abort_ptr, RANK: tl.constexpr, RANKS: tl.constexpr):
    """Tell every other rank's program ``pid`` that this one has made ``call`` calls, then wait until
    every other rank's has."""
    for q in tl.static_range(RANKS):
        if q != RANK:
            theirs = tl.load(counts_table_ptr + q).to(tl.pointer_type(tl.int64))
            tl.atomic_xchg(theirs + RANK * COUNTS_ROW + pid, call, sem="relaxed", scope="sys")
    for q in tl.static_range(RANKS):
        if q != RANK:
            wait_for_count(my_counts_ptr + q * COUNTS_ROW + pid, call, abort_ptr)


@triton.jit
def _row_sum(products_ptr, at, mask, dtype, BLOCK: tl.constexpr, RANKS: tl.constexpr):
    """The ranks' products at ``at``, summed in rank order in fp32."""
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for q in tl.static_range(RANKS):
        acc += tl.load(_product(products_ptr, q, dtype) + at, mask=mask, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _product(products_ptr, q, dtype):
    """Rank ``q``'s product, its address from the table: 16-byte aligned (symmetric buffers, slots of
    8 MiB), said so, or the loads of every row go one element at a time."""
    return tl.multiple_of(tl.load(products_ptr + q).to(tl.pointer_type(dtype)), 16)


@triton.jit(do_not_specialize=["n_rows"])  # a step's rows (compile_watch)
def _ranks_add_rms_norm_kernel(
    products_ptr,  # [RANKS] int64: each rank's [T, N] product (model dtype) as mapped here
    res_ptr,  # [T, N] the residual stream (read when HAS_RESIDUAL)
    w_ptr,  # [N]
    out_ptr,  # [T, N] normalised
    res_out_ptr,  # [T, N] the residual stream plus the sum
    my_counts_ptr,  # [MAX_RANKS, MAX_PROGRAMS] int64, this rank's: rank q's program i writes [q, i]
    counts_table_ptr,  # [RANKS] int64: each rank's counts as mapped here
    calls_ptr,  # [MAX_PROGRAMS] int64, this rank's own: the calls program i has made
    abort_ptr,  # [1] int32, local: nonzero once a peer is gone
    n_rows,
    n_cols,
    stride,  # row stride of every [T, N] operand
    eps,
    RANK: tl.constexpr,
    RANKS: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr = True,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = out_ptr.dtype.element_ty
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # one atomic, its answer shared by the program's warps (peer_norm.py says why not a load)
    call = tl.atomic_add(calls_ptr + pid, 1, sem="relaxed", scope="gpu") + 1
    _meet(my_counts_ptr, counts_table_ptr, call, pid, abort_ptr, RANK, RANKS)
    for row in range(pid, n_rows, tl.num_programs(0)):
        at = row * stride + cols  # T x N < 2**31: a slot holds at most 8 MiB
        summed = _row_sum(products_ptr, at, mask, dtype, BLOCK, RANKS)
        add_norm_store(summed, at, mask, res_ptr, w, out_ptr, res_out_ptr, n_cols, eps, HAS_RESIDUAL)


_bound = BoundKernel(_ranks_add_rms_norm_kernel)


def ranks_add_rms_norm(
    products: torch.Tensor,  # [ranks] int64: each rank's [T, N] product's address, as mapped here
    rank: int,
    mine: torch.Tensor,  # [T, N] this rank's product (``products[rank]``'s tensor): shape and dtype
    residual: torch.Tensor | None,  # [T, N]; None: the stream is the sum alone (the embedding's)
    weight: torch.Tensor,  # [N]
    eps: float,
    my_counts: torch.Tensor,  # [MAX_RANKS * MAX_PROGRAMS] int64
    counts_table: torch.Tensor,  # [ranks] int64: each rank's ``my_counts`` as mapped here
    calls: torch.Tensor,  # [MAX_PROGRAMS] int64
    abort: torch.Tensor,  # [1] int32
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(sum + residual) * weight, sum + residual)`` as new tensors, the sum over the ranks'
    products in rank order. Every rank must make the same call (same rows) at the same point."""
    ranks = products.numel()
    tokens, n = mine.shape
    if not 2 <= ranks <= MAX_RANKS or not 0 <= rank < ranks:
        raise ValueError(f"rank {rank} of {ranks}: need 2 to {MAX_RANKS} ranks")
    if n > MAX_HIDDEN:
        raise ValueError(f"hidden {n} must be <= {MAX_HIDDEN}")
    if residual is not None and (residual.shape != mine.shape or residual.dtype != mine.dtype):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match {tuple(mine.shape)}")
    if (
        products.dtype != torch.int64
        or counts_table.shape != products.shape
        or counts_table.dtype != torch.int64
    ):
        raise ValueError("products and counts_table must be int64 address tables, one entry a rank")
    if my_counts.numel() < MAX_RANKS * MAX_PROGRAMS or my_counts.dtype != torch.int64:
        raise ValueError(f"my_counts must hold {MAX_RANKS} x {MAX_PROGRAMS} int64 counts")
    out = torch.empty_like(mine)
    res_out = torch.empty_like(mine)
    if tokens == 0:
        return out, res_out
    programs = min(tokens, MAX_PROGRAMS, calls.numel())
    block = triton.next_power_of_2(n)
    _bound(
        (programs,),
        products,
        mine if residual is None else residual,  # unread without a residual
        weight,
        out,
        res_out,
        my_counts,
        counts_table,
        calls,
        abort,
        tokens,
        n,
        n,
        eps,
        RANK=rank,
        RANKS=ranks,
        BLOCK=block,
        HAS_RESIDUAL=residual is not None,
        num_warps=num_warps or min(16, max(1, block // 512)),
    )
    return out, res_out


def ranks_add_rms_norm_ref(
    products: list[torch.Tensor], residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: the ranks' products summed in rank order in fp32, rounded to the model dtype
    once, then ``add_rms_norm_ref``."""
    from prefixserve.model.kernels.rms_norm import add_rms_norm_ref

    acc = torch.zeros(products[0].shape, dtype=torch.float32, device=products[0].device)
    for product in products:
        acc = acc + product.float()
    return add_rms_norm_ref(acc.to(products[0].dtype), weight, eps, residual)


__all__ = ["MAX_RANKS", "ranks_add_rms_norm", "ranks_add_rms_norm_ref"]
