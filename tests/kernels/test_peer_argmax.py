"""The two-rank argmax exchange over peer memory against ``compute_argmax``'s torch pick.

One process plays one rank: the peer's (score, column) pairs and its count are already in place, as
after the peer's programs ran first. (Two real ranks over NVLink: ``tests/test_tensor_parallel_gpu.py``.)"""

from __future__ import annotations

import pytest
import torch
from _kernel_helpers import DEVICE

from prefixserve.model.kernels.peer_argmax import BLOCK, peer_argmax, peer_argmax_ref

CAP = 3 * BLOCK


def _exchange(rows: int, rank: int, peer_scores: torch.Tensor, peer_cols: torch.Tensor, logits, local, start):
    mine = torch.full((2, CAP), float("nan"), device=DEVICE)
    peer = torch.zeros(2, CAP, device=DEVICE)
    peer[0, :rows], peer[1, :rows] = peer_scores, peer_cols
    flags = torch.full((8,), 5, dtype=torch.int64, device=DEVICE)  # the peer's 5th call has signalled
    peer_flags = torch.full((8,), 4, dtype=torch.int64, device=DEVICE)
    calls = torch.full((8,), 4, dtype=torch.int64, device=DEVICE)
    tokens = peer_argmax(logits, local, start, rank, mine, peer, flags, peer_flags, calls)
    return tokens, mine, peer_flags, calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("rows", [1, 7, BLOCK + 3])
def test_peer_argmax_matches_the_torch_pick(dtype: torch.dtype, rank: int, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows * 2 + rank)
    vocab, start = 300, 0 if rank == 0 else 300
    logits = torch.randn(rows, vocab, generator=gen).to(DEVICE, dtype)
    local = logits.float().argmax(-1)
    peer_scores = torch.randn(rows, generator=gen).to(DEVICE) + 2.5  # about half the rows each way
    peer_cols = torch.randint(0, vocab, (rows,), generator=gen).to(DEVICE).float() + (300 - start)
    ties = torch.arange(rows, device=DEVICE) % 3 == 0  # a third of the rows tie exactly
    peer_scores[ties] = logits[torch.arange(rows, device=DEVICE), local].float()[ties]
    tokens, mine, peer_flags, calls = _exchange(rows, rank, peer_scores, peer_cols, logits, local, start)
    want = peer_argmax_ref(logits, local, start, rank, torch.stack([peer_scores, peer_cols]))
    assert torch.equal(tokens, want)
    # ties go to rank 0: its column wherever the scores are equal
    rank0_cols = (local + start) if rank == 0 else peer_cols.long()
    assert torch.equal(tokens[ties], rank0_cols[ties])
    assert torch.equal(mine[1, :rows], (local + start).float())  # this rank's pair, for the peer
    programs = -(-rows // BLOCK)
    assert calls[:programs].eq(5).all() and peer_flags[:programs].eq(5).all() and calls[programs:].eq(4).all()


@pytest.mark.parametrize("rank", [0, 1])
def test_peer_argmax_takes_nan_as_the_largest_score(rank: int) -> None:
    """As ``torch.argmax`` over the ranks' scores: a NaN wins over any number, and rank 0's NaN over
    rank 1's."""
    logits = torch.tensor([[0.0, 1.0], [float("nan"), 0.0], [float("nan"), 0.0], [3.0, 0.0]], device=DEVICE)
    local = torch.tensor([1, 0, 0, 0], device=DEVICE)
    peer_scores = torch.tensor([float("nan"), 5.0, float("nan"), 2.0], device=DEVICE)
    peer_cols = torch.tensor([7.0, 8.0, 9.0, 10.0], device=DEVICE)
    tokens, *_ = _exchange(4, rank, peer_scores, peer_cols, logits, local, 0)
    want = peer_argmax_ref(logits, local, 0, rank, torch.stack([peer_scores, peer_cols]))
    assert torch.equal(tokens, want)
    assert tokens.tolist() == ([7, 0, 0, 0] if rank == 0 else [7, 0, 9, 0])


def test_peer_argmax_refuses_what_does_not_fit() -> None:
    logits = torch.zeros(CAP + 1, 4, device=DEVICE)
    local = torch.zeros(CAP + 1, dtype=torch.long, device=DEVICE)
    buf = torch.zeros(2, CAP, device=DEVICE)
    flags = torch.zeros(8, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="do not fit"):
        peer_argmax(logits, local, 0, 0, buf, buf, flags, flags, flags)
    with pytest.raises(ValueError, match="two ranks"):
        peer_argmax(logits[:2], local[:2], 0, 2, buf, buf, flags, flags, flags)


def test_a_raised_abort_ends_the_wait_for_a_peer_that_never_signals() -> None:
    """A dead peer's count never comes: with the abort flag raised the exchange returns at once."""
    logits = torch.randn(5, 16, device=DEVICE)
    local = logits.argmax(-1)
    buf = torch.zeros(2, CAP, device=DEVICE)
    flags = torch.zeros(8, dtype=torch.int64, device=DEVICE)  # the peer never signalled
    calls = torch.zeros(8, dtype=torch.int64, device=DEVICE)
    abort = torch.ones(1, dtype=torch.int32, device=DEVICE)
    tokens = peer_argmax(logits, local, 0, 0, buf, buf.clone(), flags, flags.clone(), calls, abort)
    assert tokens.shape == (5,) and calls[0] == 1
