"""More than two ranks' row-parallel products summed over NVLink, the residual added and RMSNorm applied.

``peer_norm.py`` does this for two ranks; past two, PyTorch's two-shot all-reduce then ``add_rms_norm``
was three kernels, copies and their gaps per call. Here every rank maps every rank's product slot
(``peer_allreduce._FusedSlots``: a table of addresses, this rank's own among them), and one kernel
sums, adds the residual and normalises, in one of two ways:

- one-shot: each program reads its rows from every rank's product ((N - 1) whole products over
  NVLink a rank), after one meeting;
- two-shot: rows go in groups of N, row ``q`` of a group summed by rank ``q`` alone (1 / N of the rows
  from every rank), its sum written over this rank's own product row (no other rank reads that row
  before the second meeting); after a second meeting each rank reads the group's sums, all rows at
  once, and normalises every row itself: 2 (N - 1) / N products a rank cross NVLink, as in a
  two-shot all-reduce, and the norm rides along.

Every rank sums the ranks' products in rank order in fp32 and rounds once, so every rank's residual
stream is the same bit for bit (in two-shot each row's sum is made once and copied).

Meetings go by call count as at two ranks: program ``i`` raises its own count (one atomic per call,
by the call's meetings), writes each meeting's number into every other rank's flag ``[rank, i]``
and reads its own flags ``[q, i]`` (acquire) until every other rank ``q`` has reached it. Consecutive
calls use different slots (``peer_allreduce``), which with one meeting a call makes reuse safe for
the reason ``peer_norm.py`` gives; a second meeting changes nothing there. A raised abort flag ends
every wait (``wait_for_count``).
"""

from __future__ import annotations

import torch

from prefixserve.model.kernels.bound import BoundKernel
from prefixserve.model.kernels.peer_norm import MAX_HIDDEN, MAX_PROGRAMS, add_norm_store, wait_for_count
from prefixserve.triton_support import require_triton

triton, tl = require_triton()

MAX_RANKS = 8  # one host's NVLink domain
COUNTS_ROW: tl.constexpr = tl.constexpr(MAX_PROGRAMS)  # a rank's row of the counts (a jit global)


@triton.jit
def _meet(
    my_counts_ptr,
    counts_table_ptr,
    meeting,
    pid,
    abort_ptr,
    RANK: tl.constexpr,
    RANKS: tl.constexpr,
    RELEASE: tl.constexpr,
):
    """Tell every other rank's program ``pid`` that this one reached ``meeting`` (with ``RELEASE``,
    after this program's stores), then wait until every other rank's has."""
    for q in tl.static_range(RANKS):
        if q != RANK:
            theirs = tl.load(counts_table_ptr + q).to(tl.pointer_type(tl.int64)) + RANK * COUNTS_ROW + pid
            if RELEASE:
                tl.atomic_xchg(theirs, meeting, sem="release", scope="sys")
            else:
                tl.atomic_xchg(theirs, meeting, sem="relaxed", scope="sys")
    for q in tl.static_range(RANKS):
        if q != RANK:
            wait_for_count(my_counts_ptr + q * COUNTS_ROW + pid, meeting, abort_ptr)


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
    calls_ptr,  # [MAX_PROGRAMS] int64, this rank's own: the meetings program i has had
    abort_ptr,  # [1] int32, local: nonzero once a peer is gone
    n_rows,
    n_cols,
    stride,  # row stride of every [T, N] operand
    eps,
    RANK: tl.constexpr,
    RANKS: tl.constexpr,
    RANKS_P2: tl.constexpr,  # RANKS rounded up to a power of two (a group's tile)
    BLOCK: tl.constexpr,
    TWO_SHOT: tl.constexpr = False,
    HAS_RESIDUAL: tl.constexpr = True,
):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = out_ptr.dtype.element_ty
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # one atomic, its answer shared by the program's warps (peer_norm.py says why not a load)
    if TWO_SHOT:
        meeting = tl.atomic_add(calls_ptr + pid, 2, sem="relaxed", scope="gpu") + 1
    else:
        meeting = tl.atomic_add(calls_ptr + pid, 1, sem="relaxed", scope="gpu") + 1
    # the products are the kernels' before this one, complete before it began: one meeting makes
    # every rank's ready to read, and nothing of this kernel's needs ordering before it
    _meet(my_counts_ptr, counts_table_ptr, meeting, pid, abort_ptr, RANK, RANKS, False)
    if TWO_SHOT:
        mine = _product(products_ptr, RANK, dtype)
        groups = tl.cdiv(n_rows, RANKS)
        for group in range(pid, groups, programs):  # this rank's row of each group: its sum, for all
            row = group * RANKS + RANK
            if row < n_rows:
                at = row * stride + cols
                summed = _row_sum(products_ptr, at, mask, dtype, BLOCK, RANKS)
                tl.store(mine + at, summed.to(dtype), mask=mask)
        tl.debug_barrier()  # every thread's stores issued before the release below
        _meet(my_counts_ptr, counts_table_ptr, meeting + 1, pid, abort_ptr, RANK, RANKS, True)
        # every row of the group at once (their loads all in flight), this rank's own among them: one
        # code path normalises each row on every rank, so every rank's output is the same bit for bit
        ranks = tl.arange(0, RANKS_P2)
        owners = tl.load(products_ptr + ranks, mask=ranks < RANKS, other=0).to(tl.pointer_type(dtype))
        owners = tl.multiple_of(owners, 16)
        for group in range(pid, groups, programs):
            rows = group * RANKS + ranks
            at2 = rows[:, None] * stride + cols[None, :]
            mask2 = ((ranks < RANKS) & (rows < n_rows))[:, None] & mask[None, :]
            x = tl.load(owners[:, None] + at2, mask=mask2, other=0.0)  # the sums, model dtype
            if HAS_RESIDUAL:
                r = tl.load(res_ptr + at2, mask=mask2, other=0.0).to(tl.float32)
                x = (x.to(tl.float32) + r).to(dtype)
            tl.store(res_out_ptr + at2, x, mask=mask2)
            xf = x.to(tl.float32)
            rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=1) / n_cols + eps)
            normed = (xf * rstd[:, None]).to(dtype).to(tl.float32)
            tl.store(out_ptr + at2, (normed * w[None, :]).to(dtype), mask=mask2)
    else:
        for row in range(pid, n_rows, programs):
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
    two_shot: bool = False,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(sum + residual) * weight, sum + residual)`` as new tensors, the sum over the ranks'
    products in rank order. Every rank must make the same call (same rows, same ``two_shot``) at the
    same point. With ``two_shot`` this rank's product is overwritten with sums."""
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
    work = triton.cdiv(tokens, ranks) if two_shot else tokens
    programs = min(work, MAX_PROGRAMS, calls.numel())
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
        RANKS_P2=triton.next_power_of_2(ranks),
        BLOCK=block,
        TWO_SHOT=two_shot,
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
