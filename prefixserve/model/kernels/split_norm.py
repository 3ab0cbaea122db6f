"""Two ranks' row-parallel products summed in two column parts, so that the first part's sum runs
while the second part's matmul does: the all-reduce hidden behind the product that feeds it.

``peer_norm.py`` sums a whole [T, N] product after the matmul that writes it has finished, and a decode
layer has nothing else to run meanwhile: at the 70B's TP=2 shards (N = 8,192) that is 161 calls of
about 17 us a step. Here the row-parallel matmul is split along its output columns (the weight's rows,
so each half reads its half of the weight once): the first half's product is written, then summed
with the peer's by ``peer_sum`` on a second stream while the second half's matmul runs, and
``peer_finish_norm`` sums the second half, adds the residual to the whole row and normalises it,
reading the first half's sum from local memory. Each product part lives in a plane of its own
([parts, T, N / parts] in the product slot), so each matmul writes a contiguous [T, N / parts].

Both kernels meet the peer as ``peer_norm``'s count meeting does (program ``i`` with the peer's
program ``i``, by call count, the same counts), and the two-slot argument covers them: a rank's
second-stream call is joined back into its stream before the finish, so every read of a slot is done
before the rank's next meeting. The rounding is ``peer_norm``'s: each element's two products summed
in fp32 and rounded to the model dtype once, then the residual added, so the result equals the unsplit
call's for the same products.
"""

from __future__ import annotations

import torch

from prefixserve.model.kernels.bound import BoundKernel
from prefixserve.model.kernels.peer_norm import MAX_HIDDEN, MAX_PROGRAMS, add_norm_store, wait_for_count
from prefixserve.triton_support import require_triton

triton, tl = require_triton()


@triton.jit
def _meet(calls_ptr, my_flags_ptr, peer_flags_ptr, abort_ptr, pid):
    """Program ``pid``'s call-count meeting with the peer's (``peer_norm.py`` says why one atomic)."""
    call = tl.atomic_add(calls_ptr + pid, 1, sem="relaxed", scope="gpu") + 1
    tl.atomic_xchg(peer_flags_ptr + pid, call, sem="relaxed", scope="sys")
    wait_for_count(my_flags_ptr + pid, call, abort_ptr)


@triton.jit(do_not_specialize=["n_rows"])
def _peer_sum_kernel(
    mine_ptr,  # [T, C] this rank's first product part
    peer_ptr,  # [T, C] the peer's, in its memory
    out_ptr,  # [T, C] the sum, rounded to the model dtype
    my_flags_ptr,
    peer_flags_ptr,
    calls_ptr,
    abort_ptr,
    n_rows,
    n_cols,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    _meet(calls_ptr, my_flags_ptr, peer_flags_ptr, abort_ptr, pid)
    for row in range(pid, n_rows, tl.num_programs(0)):
        at = row * n_cols + cols
        a = tl.load(mine_ptr + at, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(peer_ptr + at, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + at, (a + b).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n_rows"])
def _peer_finish_kernel(
    first_ptr,  # [T, F] the first part's sum (``peer_sum``), local
    mine_ptr,  # [T, N - F] this rank's last product part
    peer_ptr,  # [T, N - F] the peer's
    res_ptr,  # [T, N] the residual stream (read when HAS_RESIDUAL)
    w_ptr,  # [N]
    out_ptr,  # [T, N] normalised
    res_out_ptr,  # [T, N] the residual stream plus the sum
    my_flags_ptr,
    peer_flags_ptr,
    calls_ptr,
    abort_ptr,
    n_rows,
    n_first,
    n_cols,
    eps,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr = True,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    head = cols < n_first
    tail = mask & (cols >= n_first)
    n_last = n_cols - n_first
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    _meet(calls_ptr, my_flags_ptr, peer_flags_ptr, abort_ptr, pid)
    for row in range(pid, n_rows, tl.num_programs(0)):
        first = tl.load(first_ptr + row * n_first + cols, mask=head, other=0.0).to(tl.float32)
        last_at = row * n_last + cols - n_first  # read only where ``tail``
        a = tl.load(mine_ptr + last_at, mask=tail, other=0.0).to(tl.float32)
        b = tl.load(peer_ptr + last_at, mask=tail, other=0.0).to(tl.float32)
        summed = tl.where(head, first, a + b)  # the first part is already rounded: exact again
        add_norm_store(
            summed, row * n_cols + cols, mask, res_ptr, w, out_ptr, res_out_ptr, n_cols, eps, HAS_RESIDUAL
        )


_sum = BoundKernel(_peer_sum_kernel)
_finish = BoundKernel(_peer_finish_kernel)


def _programs(rows: int, flags: tuple[torch.Tensor, ...], programs: int | None) -> int:
    return min(rows, MAX_PROGRAMS, programs or MAX_PROGRAMS, *(f.numel() for f in flags))


def _check_flags(my_flags: torch.Tensor, peer_flags: torch.Tensor, calls: torch.Tensor) -> None:
    if not my_flags.dtype == peer_flags.dtype == calls.dtype == torch.int64:
        raise ValueError("split sums meet by call count: int64 flags and calls")


def peer_sum(
    mine: torch.Tensor,  # [T, C]
    peer: torch.Tensor,  # [T, C]
    out: torch.Tensor,  # [T, C]
    my_flags: torch.Tensor,
    peer_flags: torch.Tensor,
    calls: torch.Tensor,
    abort: torch.Tensor,
    programs: int | None = None,
) -> torch.Tensor:
    """``out = mine + peer`` (fp32, rounded once), the peer making the same call at the same point."""
    if not (mine.shape == peer.shape == out.shape and mine.dtype == peer.dtype == out.dtype):
        raise ValueError(f"peer_sum operands differ: {mine.shape} {peer.shape} {out.shape}")
    if not all(t.is_contiguous() for t in (mine, peer, out)):
        raise ValueError("peer_sum needs contiguous rows")
    _check_flags(my_flags, peer_flags, calls)
    rows, cols = mine.shape
    if rows:
        n = _programs(rows, (my_flags, peer_flags, calls), programs)
        block = triton.next_power_of_2(cols)
        args = (mine, peer, out, my_flags, peer_flags, calls, abort, rows, cols)
        _sum((n,), *args, BLOCK=block, num_warps=min(16, max(1, block // 512)))
    return out


def peer_finish_norm(
    first: torch.Tensor,  # [T, F] the first part's sum (``peer_sum``)
    mine: torch.Tensor,  # [T, N - F]
    peer: torch.Tensor,  # [T, N - F]
    residual: torch.Tensor | None,  # [T, N]
    weight: torch.Tensor,  # [N]
    eps: float,
    my_flags: torch.Tensor,
    peer_flags: torch.Tensor,
    calls: torch.Tensor,
    abort: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x) * weight, x)`` with ``x = [first, mine + peer] + residual``, as
    ``peer_add_rms_norm`` gives for the whole product; the peer makes the same call."""
    rows, n_first = first.shape
    n = weight.shape[0]
    if mine.shape != (rows, n - n_first) or peer.shape != mine.shape:
        raise ValueError(
            f"last parts {tuple(mine.shape)} {tuple(peer.shape)} must be [{rows}, {n - n_first}]"
        )
    if residual is not None and residual.shape != (rows, n):
        raise ValueError(f"residual {tuple(residual.shape)} must be [{rows}, {n}]")
    if n > MAX_HIDDEN:
        raise ValueError(f"hidden {n} must be <= {MAX_HIDDEN}")
    if not all(t.is_contiguous() for t in (first, mine, peer)):
        raise ValueError("peer_finish_norm needs contiguous parts")
    _check_flags(my_flags, peer_flags, calls)
    out = torch.empty(rows, n, dtype=mine.dtype, device=mine.device)
    res_out = torch.empty_like(out)
    if rows:
        block = triton.next_power_of_2(n)
        _finish(
            (_programs(rows, (my_flags, peer_flags, calls), None),),
            first,
            mine,
            peer,
            res_out if residual is None else residual,  # unread without a residual
            weight,
            out,
            res_out,
            my_flags,
            peer_flags,
            calls,
            abort,
            rows,
            n_first,
            n,
            eps,
            BLOCK=block,
            HAS_RESIDUAL=residual is not None,
            num_warps=min(16, max(1, block // 512)),
        )
    return out, res_out


__all__ = ["peer_finish_norm", "peer_sum"]
