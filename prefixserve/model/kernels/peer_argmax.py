"""The sharded argmax's exchange at two ranks: each rank's best column, traded over NVLink, one kernel.

Under tensor parallelism a greedy step's tokens come from each rank's argmax over its vocabulary
columns: the ranks trade (score, column) per row and the first rank holding a row's largest score
wins. Through NCCL that is a gather of the scores, a stack, an all-gather, an argmax over the ranks
and an index (about ten launches and NCCL's own floor, 30-40 us a step at B=256). Here each program
reads its rows' scores from the logits, writes (score, column) into this rank's symmetric buffer,
meets the peer's program of the same index and reads the peer's pair over NVLink: one launch.

Meeting by call count, as ``peer_norm.py`` does: the program raises its own count of calls, writes
it into the peer's flag with release (its pair's stores are seen first) and waits (acquire) until
its own flag shows the peer's count has reached its own. Before a rank writes its pair again (the
next step's argmax), its next forward has met the peer in collectives that the peer started only
after finishing this argmax (stream order), so one buffer is enough.

Ties and NaN follow ``torch.argmax`` over the ranks' scores in rank order: rank 1's column wins only
where its score is larger, or NaN where rank 0's is not (argmax takes NaN as the largest value).
Columns travel as fp32 (exact below 2**24, ``LlamaForCausalLM.argmax_exact``).
"""

from __future__ import annotations

import torch

from prefixserve.model.kernels.peer_norm import wait_for_count
from prefixserve.triton_support import require_triton
from prefixserve.triton_support.bound import BoundKernel

triton, tl = require_triton()

BLOCK = 128  # rows a program trades
MAX_PROGRAMS = 32  # flags per rank: up to 4,096 rows


@triton.jit(do_not_specialize=["n_rows"])
def _peer_argmax_kernel(
    logits_ptr,  # [R, V_shard] this rank's logits
    local_ptr,  # [R] int64: each row's best column of this rank's shard
    mine_ptr,  # [2, cap] fp32, this rank's symmetric buffer: scores, then global columns
    peer_ptr,  # [2, cap] fp32, the peer's (read over NVLink)
    out_ptr,  # [R] int64 tokens
    my_flags_ptr,  # [MAX_PROGRAMS] int64: the peer's program i writes its count of calls here
    peer_flags_ptr,  # [MAX_PROGRAMS] int64, in the peer's memory
    calls_ptr,  # [MAX_PROGRAMS] int64: this rank's own counts of calls
    abort_ptr,  # [1] int32, local: nonzero once the peer is gone (the wait gives up)
    n_rows,
    stride,  # the logits' row stride
    start,  # this rank's first vocabulary column
    cap,
    RANK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK + tl.arange(0, BLOCK)
    ok = rows < n_rows
    local = tl.load(local_ptr + rows, mask=ok, other=0)
    score = tl.load(logits_ptr + rows.to(tl.int64) * stride + local, mask=ok, other=0.0).to(tl.float32)
    column = (local + start).to(tl.float32)
    tl.store(mine_ptr + rows, score, mask=ok)
    tl.store(mine_ptr + cap + rows, column, mask=ok)
    tl.debug_barrier()  # every thread's pair stored before the release below
    call = tl.atomic_add(calls_ptr + pid, 1, sem="relaxed", scope="gpu") + 1
    tl.atomic_xchg(peer_flags_ptr + pid, call, sem="release", scope="sys")
    wait_for_count(my_flags_ptr + pid, call, abort_ptr)
    peer_score = tl.load(peer_ptr + rows, mask=ok, other=0.0)
    peer_column = tl.load(peer_ptr + cap + rows, mask=ok, other=0.0)
    if RANK == 0:  # this rank's pair comes first
        first, second, first_col, second_col = score, peer_score, column, peer_column
    else:
        first, second, first_col, second_col = peer_score, score, peer_column, column
    take_second = (second > first) | ((second != second) & (first == first))
    tl.store(out_ptr + rows, tl.where(take_second, second_col, first_col).to(tl.int64), mask=ok)


_bound = BoundKernel(_peer_argmax_kernel)


def peer_argmax(
    logits: torch.Tensor,  # [R, V_shard]
    local: torch.Tensor,  # [R] int64: argmax over this rank's columns
    start: int,
    rank: int,
    mine: torch.Tensor,  # [2, cap] fp32 symmetric
    peer: torch.Tensor,  # [2, cap] fp32, the peer's
    my_flags: torch.Tensor,  # [MAX_PROGRAMS] int64
    peer_flags: torch.Tensor,  # [MAX_PROGRAMS] int64, the peer's
    calls: torch.Tensor,  # [MAX_PROGRAMS] int64
    abort: torch.Tensor | None = None,  # [1] int32: set nonzero (``PeerAbort``), the wait gives up
) -> torch.Tensor:
    """The tokens [R] (int64) of the two ranks' argmax; the peer makes the same call at the same point.
    Once ``abort`` is nonzero the call returns without waiting for the peer (its tokens are then
    meaningless: the caller has given up on the peer). Without ``abort`` (tests) a zero is made."""
    rows = logits.shape[0]
    cap = mine.shape[1]
    programs = triton.cdiv(rows, BLOCK)
    if rank not in (0, 1):
        raise ValueError(f"rank {rank}: the exchange is between two ranks")
    if rows > cap or programs > min(my_flags.numel(), peer_flags.numel(), calls.numel()):
        raise ValueError(f"{rows} rows do not fit the exchange ({cap} rows, {calls.numel()} programs)")
    if local.shape != (rows,) or logits.stride(1) != 1 or mine.shape != peer.shape:
        raise ValueError("peer_argmax needs [R, V] logits with contiguous rows and [R] columns")
    out = torch.empty(rows, dtype=torch.long, device=logits.device)
    if abort is None:
        abort = torch.zeros(1, dtype=torch.int32, device=logits.device)
    if rows:
        _bound(
            (programs,),
            logits,
            local,
            mine,
            peer,
            out,
            my_flags,
            peer_flags,
            calls,
            abort,
            rows,
            logits.stride(0),
            start,
            cap,
            RANK=rank,
            BLOCK=BLOCK,
            num_warps=4,
        )
    return out


def peer_argmax_ref(
    logits: torch.Tensor, local: torch.Tensor, start: int, rank: int, peer_pairs: torch.Tensor
) -> torch.Tensor:
    """Torch reference: this rank's (score, column) and the peer's ``peer_pairs`` [2, R] stacked in
    rank order, then ``compute_argmax``'s pick (argmax over the ranks' scores)."""
    rows = torch.arange(logits.shape[0], device=logits.device)
    mine = torch.stack([logits[rows, local].float(), (local + start).float()])
    every = torch.stack([mine, peer_pairs] if rank == 0 else [peer_pairs, mine])  # [2 ranks, 2, R]
    winner = every[:, 0].argmax(0)
    return every[winner, 1, rows].long()


__all__ = ["MAX_PROGRAMS", "peer_argmax", "peer_argmax_ref"]
