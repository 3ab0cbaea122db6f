"""Two ranks' row-parallel products summed over NVLink, the residual added and RMSNorm applied: one kernel.

At TP=2 every layer of a decode step ends its attention and its MLP the same way: a row-parallel
product on each rank, an all-reduce of [B, hidden], then the residual add and the next RMSNorm. Through
PyTorch's two-shot all-reduce that is two kernels (the all-reduce, with its own barriers between the
ranks, then ``add_rms_norm``) and the message crosses NVLink twice (reduce-scatter, all-gather). Here
each rank reads the peer's whole partial once, straight from the peer's symmetric buffer, and adds it
to its own in the same pass that adds the residual and normalises: one kernel, one barrier, and both
ranks compute the identical sum (``a + b`` is commutative in IEEE arithmetic, so the replicated
residual streams never drift apart).

Synchronisation: program ``i`` on each rank meets program ``i`` on the other once a call, by call
count: each program raises its own count of calls by one (one atomic, its answer shared by the
program's warps), writes the count into the peer's int64 flag ``i`` without waiting for an answer,
and reads its own flag ``i`` (acquire) until the peer's count has reached its own. The peer's
product is the kernel before's output, complete before this kernel began, so the count goes out
relaxed. Counts only grow, so graph replays need no reset. (Meeting by compare-and-swap flags, and
pushing each rank's product into the peer's memory before the signal, lost to this at every size
and are gone: docs/kernels.md §3.)

Why one barrier is enough: consecutive calls use different product buffers (slot 0 after attention,
slot 1 after the MLP, slot 2 for the embedding's lookups before the first layer's norm: a forward
is 2, 0, 1, 0, 1, ..., 0, 1). Before a rank writes slot s again (two or more calls later), its
program ``i`` has met the peer's program ``i`` of a call in between, which started only after the
peer's kernel that read slot s had finished (stream order).

A rank whose peer died would wait for a signal that never comes, its stream stuck for the life of
the process: every wait also reads a local abort flag, which rank 0 raises once it learns a worker
is gone (``peer_allreduce.PeerAbort``), and then returns without the peer.

The rounding follows ``add_rms_norm``: the two products are summed in fp32 and rounded to the model
dtype (a correctly rounded add, as the two-shot all-reduce's), the residual added in the model dtype.
"""

from __future__ import annotations

import torch

from prefixserve.triton_support import require_triton
from prefixserve.triton_support.bound import BoundKernel

triton, tl = require_triton()

MAX_HIDDEN = 16384  # one row per program iteration, in registers
MAX_PROGRAMS = 512  # flags per rank; programs past the rows loop over them (all resident on an H100)
# a wait reads the abort flag once every this many polls of its own flag (a read each poll cost up to
# 0.5 us a call, docs/kernels.md §8)
ABORT_POLLS: tl.constexpr = tl.constexpr(1024)


@triton.jit
def _polled(polls, gone, abort_ptr):
    """One more poll of a wait: (polls, the abort flag as last read, once every ``ABORT_POLLS``)."""
    polls += 1
    if polls % ABORT_POLLS == 0:  # a long wait: has the peer gone?
        gone = tl.load(abort_ptr, volatile=True)
    return polls, gone


@triton.jit
def wait_for_count(flag_ptr, call, abort_ptr):
    """Read this rank's flag (acquire) until the peer's count there reaches ``call``, or until the
    abort flag is raised."""
    gone = tl.full([], 0, tl.int32)
    polls = tl.full([], 0, tl.int32)
    while (tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys") < call) & (gone == 0):
        polls, gone = _polled(polls, gone, abort_ptr)


@triton.jit(do_not_specialize=["n_rows"])  # a step's rows (compile_watch)
def _peer_add_rms_norm_kernel(
    mine_ptr,  # [T, N] this rank's product (model dtype)
    peer_ptr,  # [T, N] the peer's product, in its memory (read over NVLink)
    res_ptr,  # [T, N] the residual stream (read when HAS_RESIDUAL)
    w_ptr,  # [N]
    out_ptr,  # [T, N] normalised
    res_out_ptr,  # [T, N] the residual stream plus the sum
    my_flags_ptr,  # [MAX_PROGRAMS]: the peer's program i signals flag i here
    peer_flags_ptr,  # [MAX_PROGRAMS], in the peer's memory: this rank's program i signals flag i
    calls_ptr,  # [MAX_PROGRAMS] int64, this rank's own: the calls program i has made
    abort_ptr,  # [1] int32, local: nonzero once the peer is gone (every wait gives up)
    n_rows,
    n_cols,
    stride,  # row stride of every [T, N] operand
    eps,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr = True,  # False: the first norm, whose stream is the sum alone
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    # meet the peer's program pid: signal it, then wait for its signal. One atomic, its answer shared
    # by the program's warps: a load and a store would let a late warp read the count an early one
    # had already raised, and wait for a call not yet made
    call = tl.atomic_add(calls_ptr + pid, 1, sem="relaxed", scope="gpu") + 1
    # the product is an earlier kernel's, complete before this one began: nothing to order
    tl.atomic_xchg(peer_flags_ptr + pid, call, sem="relaxed", scope="sys")
    wait_for_count(my_flags_ptr + pid, call, abort_ptr)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    for row in range(pid, n_rows, tl.num_programs(0)):
        at = row * stride + cols  # T x N < 2**31: the buffer holds at most 16 MiB
        a = tl.load(mine_ptr + at, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(peer_ptr + at, mask=mask, other=0.0).to(tl.float32)
        add_norm_store(a + b, at, mask, res_ptr, w, out_ptr, res_out_ptr, n_cols, eps, HAS_RESIDUAL)


@triton.jit
def add_norm_store(
    summed, at, mask, res_ptr, w, out_ptr, res_out_ptr, n_cols, eps, HAS_RESIDUAL: tl.constexpr
):
    """One row's end: the ranks' fp32 ``summed`` rounded to the model dtype (the all-reduce's sum),
    the residual added, stored as the stream, normalised and stored."""
    dtype = out_ptr.dtype.element_ty
    x = summed.to(dtype)
    if HAS_RESIDUAL:  # then the residual add
        r = tl.load(res_ptr + at, mask=mask, other=0.0).to(tl.float32)
        x = (x.to(tl.float32) + r).to(dtype)
    tl.store(res_out_ptr + at, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * rstd).to(dtype).to(tl.float32)
    tl.store(out_ptr + at, (normed * w).to(dtype), mask=mask)


_bound = BoundKernel(_peer_add_rms_norm_kernel)


def peer_add_rms_norm(
    mine: torch.Tensor,  # [T, N]
    peer: torch.Tensor,  # [T, N]
    residual: torch.Tensor | None,  # [T, N]; None: the stream is the sum alone (the embedding's)
    weight: torch.Tensor,  # [N]
    eps: float,
    my_flags: torch.Tensor,  # [>= programs] int64: the peer's call counts arrive here
    peer_flags: torch.Tensor,  # the same, in the peer's memory
    calls: torch.Tensor,  # [>= programs] int64: this rank's own call counts
    num_warps: int | None = None,
    abort: torch.Tensor | None = None,  # [1] int32: set nonzero (``PeerAbort``), the waits give up
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(mine + peer + residual) * weight, mine + peer + residual)`` as new tensors (no
    residual: of ``mine + peer``); the peer must make the same call (its ``mine`` is this rank's
    ``peer``) at the same point. Once
    ``abort`` is nonzero the call returns without waiting for the peer, its outputs meaningless (the
    caller has given up on the peer). Without ``abort`` (tests, probes) a zero is made."""
    tokens, n = mine.shape
    if n > MAX_HIDDEN:
        raise ValueError(f"hidden {n} must be <= {MAX_HIDDEN}")
    stream = mine if residual is None else residual  # the kernel's res_ptr (unread without a residual)
    for name, t in (("peer", peer), ("residual", stream)):
        if t.shape != mine.shape or t.dtype != mine.dtype:
            raise ValueError(f"{name} {tuple(t.shape)} {t.dtype} must match {tuple(mine.shape)} {mine.dtype}")
    if not all(t.is_contiguous() for t in (mine, peer, stream)):
        raise ValueError("peer_add_rms_norm needs contiguous rows")
    out = torch.empty_like(mine)
    res_out = torch.empty_like(mine)
    if tokens == 0:
        return out, res_out
    programs = min(tokens, MAX_PROGRAMS, my_flags.numel(), peer_flags.numel(), calls.numel())
    if my_flags.dtype != torch.int64 or peer_flags.dtype != torch.int64:
        raise ValueError(f"flags must be torch.int64 here, got {my_flags.dtype} and {peer_flags.dtype}")
    if abort is None:
        abort = torch.zeros(1, dtype=torch.int32, device=mine.device)
    block = triton.next_power_of_2(n)
    _bound(
        (programs,),
        mine,
        peer,
        stream,
        weight,
        out,
        res_out,
        my_flags,
        peer_flags,
        calls,
        abort,
        tokens,
        n,
        n,
        eps,
        BLOCK=block,
        HAS_RESIDUAL=residual is not None,
        num_warps=num_warps or min(16, max(1, block // 512)),
    )
    return out, res_out


def peer_add_rms_norm_ref(
    mine: torch.Tensor, peer: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: the ranks' sum rounded to the model dtype, then ``add_rms_norm_ref``."""
    from prefixserve.model.kernels.rms_norm import add_rms_norm_ref

    summed = (mine.float() + peer.float()).to(mine.dtype)
    return add_rms_norm_ref(summed, weight, eps, residual)


__all__ = ["MAX_PROGRAMS", "peer_add_rms_norm", "peer_add_rms_norm_ref"]
