"""The two-part all-reduce + norm (``kernels/split_norm.py``) against the whole-product kernel.

One process plays one rank, as in ``test_peer_norm.py``: the peer's counts already show its calls.
(Two real ranks on GPUs: ``tests/test_peer_norm_gpu.py``.)"""

from __future__ import annotations

import pytest
import torch
from _kernel_helpers import DEVICE

from prefixserve.model.kernels.peer_norm import peer_add_rms_norm
from prefixserve.model.kernels.split_norm import peer_finish_norm, peer_sum

DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


def _counts(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(this rank's flags: the peer is far ahead; the peer's flags; this rank's calls)."""
    mine = torch.full((n,), 1 << 40, dtype=torch.int64, device=DEVICE)
    return (
        mine,
        torch.zeros(n, dtype=torch.int64, device=DEVICE),
        torch.zeros(n, dtype=torch.int64, device=DEVICE),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize(
    ("rows", "hidden", "first", "flags"), [(1, 64, 32, 8), (7, 96, 48, 8), (13, 80, 16, 4)]
)
def test_two_parts_equal_the_whole_product(
    dtype: torch.dtype, residual: bool, rows: int, hidden: int, first: int, flags: int
) -> None:
    gen = torch.Generator().manual_seed(rows * hidden + first)
    mine, peer, res = (torch.randn(rows, hidden, generator=gen).to(DEVICE, dtype) for _ in range(3))
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(DEVICE, dtype)
    stream = res if residual else None
    whole = peer_add_rms_norm(mine, peer, stream, w, 1e-5, *_counts(flags)[:2], calls=_counts(flags)[2])
    my_flags, peer_flags, calls = _counts(flags)
    abort = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    summed = torch.empty(rows, first, dtype=dtype, device=DEVICE)
    head, tail = (p.contiguous() for p in mine.split([first, hidden - first], 1))
    peer_head, peer_tail = (p.contiguous() for p in peer.split([first, hidden - first], 1))
    peer_sum(head, peer_head, summed, my_flags, peer_flags, calls, abort)
    parts = peer_finish_norm(summed, tail, peer_tail, stream, w, 1e-5, my_flags, peer_flags, calls, abort)
    assert torch.equal(parts[0], whole[0]) and torch.equal(parts[1], whole[1])
    programs = min(rows, flags)
    assert calls[:programs].eq(2).all() and calls[programs:].eq(0).all()  # one meeting a call
    assert peer_flags[:programs].eq(2).all()  # each told the peer its count


def test_split_sums_refuse_mismatched_parts() -> None:
    x = torch.zeros(2, 8, device=DEVICE)
    my_flags, peer_flags, calls = _counts(4)
    abort = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="differ"):
        peer_sum(x, torch.zeros(3, 8, device=DEVICE), x, my_flags, peer_flags, calls, abort)
    with pytest.raises(ValueError, match="last parts"):
        peer_finish_norm(
            x, x, x, None, torch.ones(12, device=DEVICE), 1e-6, my_flags, peer_flags, calls, abort
        )
    with pytest.raises(ValueError, match="int64"):
        peer_sum(x, x, x, my_flags.int(), peer_flags, calls, abort)
