"""The fused two-rank all-reduce + residual add + RMSNorm against its torch reference.

One process plays one rank: the "peer's" product and flags are ordinary tensors, the peer's flags
already showing its signal, as after the peer's programs ran first. (Two real ranks over NVLink:
``tests/test_tensor_parallel_gpu.py``.)"""

from __future__ import annotations

import pytest
import torch
from _kernel_helpers import DEVICE

from prefixserve.model.kernels.peer_norm import peer_add_rms_norm, peer_add_rms_norm_ref

DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


def _counts(flags: int, calls: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(this rank's flags with the peer's call ``calls + 1`` signalled, the peer's flags, this rank's
    call counts at ``calls``)."""
    mine = torch.full((flags,), calls + 1, dtype=torch.int64, device=DEVICE)
    return mine, torch.full_like(mine, calls), torch.full_like(mine, calls)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "hidden", "flags"), [(1, 64, 8), (7, 96, 8), (13, 40, 4)])
def test_peer_add_rms_norm_matches_reference(dtype: torch.dtype, rows: int, hidden: int, flags: int) -> None:
    gen = torch.Generator().manual_seed(rows * hidden)
    mine, peer, res = (torch.randn(rows, hidden, generator=gen).to(DEVICE, dtype) for _ in range(3))
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(DEVICE, dtype)
    out, summed = peer_add_rms_norm(mine, peer, res, w, 1e-5, *_counts(flags))
    ref, ref_summed = peer_add_rms_norm_ref(mine, peer, res, w, 1e-5)
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(summed, ref_summed, **tol)
    torch.testing.assert_close(out, ref, **tol)


def test_peer_add_rms_norm_sum_is_the_same_on_both_ranks() -> None:
    """Each rank adds the other's product to its own: the replicated residual stream must come out
    bit for bit the same on both, or the ranks drift apart."""
    gen = torch.Generator().manual_seed(3)
    a, b, res = (torch.randn(5, 64, generator=gen).to(DEVICE) for _ in range(3))
    w = torch.ones(64, device=DEVICE)
    out0, sum0 = peer_add_rms_norm(a, b, res, w, 1e-6, *_counts(8))
    out1, sum1 = peer_add_rms_norm(b, a, res, w, 1e-6, *_counts(8))
    assert torch.equal(sum0, sum1) and torch.equal(out0, out1)


def test_peer_add_rms_norm_refuses_mismatched_operands() -> None:
    x = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="peer"):
        peer_add_rms_norm(x, torch.zeros(3, 8, device=DEVICE), x, x[0], 1e-6, *_counts(4))


@pytest.mark.parametrize(("rows", "flags"), [(1, 8), (13, 4)])
def test_call_count_signal_counts_each_program_once(rows: int, flags: int) -> None:
    """Each program adds one to its own count, writes it to the peer's flag and goes on once its own
    flag has reached it (the peer's program of the same call, or a later one)."""
    gen = torch.Generator().manual_seed(rows + 17)
    mine, peer, res = (torch.randn(rows, 64, generator=gen).to(DEVICE) for _ in range(3))
    w = torch.ones(64, device=DEVICE)
    programs = min(rows, flags)
    my_flags, peer_flags, calls = _counts(flags, calls=41)  # the peer's 42nd call signalled
    out, summed = peer_add_rms_norm(mine, peer, res, w, 1e-5, my_flags, peer_flags, calls)
    ref, ref_summed = peer_add_rms_norm_ref(mine, peer, res, w, 1e-5)
    torch.testing.assert_close(summed, ref_summed, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert calls[:programs].eq(42).all() and calls[programs:].eq(41).all()
    assert peer_flags[:programs].eq(42).all() and peer_flags[programs:].eq(41).all()
    assert my_flags.eq(42).all()  # read, never consumed: the count only grows


def test_call_count_signal_wants_int64_flags() -> None:
    x = torch.zeros(2, 8, device=DEVICE)
    f32 = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="int64"):
        peer_add_rms_norm(x, x, x, x[0], 1e-6, f32, f32, torch.zeros(4, dtype=torch.int64, device=DEVICE))


class _Slots:
    """One rank's view of ``_FusedSlots`` on one device: the peer has already made its call."""

    size = 2

    def __init__(self, rows: int, cols: int) -> None:
        gen = torch.Generator().manual_seed(rows)
        self.mine, self.peer_product = (torch.randn(rows, cols, generator=gen).to(DEVICE) for _ in range(2))
        self.counts = torch.ones(8, dtype=torch.int64, device=DEVICE)
        self.peer_counts = torch.zeros(8, dtype=torch.int64, device=DEVICE)
        self.calls = torch.zeros(8, dtype=torch.int64, device=DEVICE)
        self.abort = torch.zeros(1, dtype=torch.int32, device=DEVICE)

    def views(self, *shape: object) -> tuple[torch.Tensor, torch.Tensor]:  # (slot, rows, cols, dtype)
        return self.mine, self.peer_product


def test_peer_sum_reads_the_peers_product_and_counts_the_call() -> None:
    """The engine's call site: it reads the peer's product from the peer's memory and raises the
    call counts."""
    from prefixserve.model.peer_allreduce import PeerSum

    slots = _Slots(rows=3, cols=32)
    res, w = torch.randn(3, 32).to(DEVICE), torch.ones(32, device=DEVICE)
    out, summed = PeerSum(slots, 0, slots.mine).add_rms_norm(res, w, 1e-5)  # type: ignore[arg-type]
    ref, ref_summed = peer_add_rms_norm_ref(slots.mine, slots.peer_product, res, w, 1e-5)
    torch.testing.assert_close(summed, ref_summed, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert slots.calls[:3].eq(1).all() and slots.peer_counts[:3].eq(1).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_peer_sum_without_a_residual_is_the_first_norm(dtype: torch.dtype) -> None:
    """The embedding's lookups (no residual stream yet): the stream out is the ranks' sum, a new
    tensor, and the norm is of that sum; the residual operand is never read."""
    gen = torch.Generator().manual_seed(11)
    mine, peer = (torch.randn(6, 96, generator=gen).to(DEVICE, dtype) for _ in range(2))
    w = (1 + 0.1 * torch.randn(96, generator=gen)).to(DEVICE, dtype)
    out, summed = peer_add_rms_norm(mine, peer, None, w, 1e-5, *_counts(8))
    ref, ref_summed = peer_add_rms_norm_ref(mine, peer, None, w, 1e-5)
    assert torch.equal(summed, ref_summed)  # one rounding of an exact fp32 sum: bit for bit
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(out, ref, **tol)
    assert summed.data_ptr() not in (mine.data_ptr(), peer.data_ptr())


def test_a_raised_abort_ends_the_wait_for_a_peer_that_never_signals() -> None:
    """A dead peer never signals: with the abort flag raised (``PeerAbort``) the call returns at once
    rather than spin for the life of the process."""
    x = torch.ones(3, 64, device=DEVICE)
    flags = torch.zeros(4, dtype=torch.int64, device=DEVICE)  # the peer's count stays behind this call's
    calls = torch.full((4,), 7, dtype=torch.int64, device=DEVICE)
    abort = torch.ones(1, dtype=torch.int32, device=DEVICE)
    out, summed = peer_add_rms_norm(x, x, x, x[0], 1e-6, flags, flags.clone(), calls, abort=abort)
    assert out.shape == summed.shape == x.shape
    assert calls[:3].eq(8).all()  # the call was counted; only the wait gave up
