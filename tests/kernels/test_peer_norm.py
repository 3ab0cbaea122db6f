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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "hidden", "flags"), [(1, 64, 8), (7, 96, 8), (13, 40, 4)])
def test_peer_add_rms_norm_matches_reference(dtype: torch.dtype, rows: int, hidden: int, flags: int) -> None:
    gen = torch.Generator().manual_seed(rows * hidden)
    mine, peer, res = (torch.randn(rows, hidden, generator=gen).to(DEVICE, dtype) for _ in range(3))
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(DEVICE, dtype)
    my_flags = torch.ones(flags, dtype=torch.int32, device=DEVICE)  # the peer has signalled
    peer_flags = torch.zeros(flags, dtype=torch.int32, device=DEVICE)  # and consumed the last signal
    out, summed = peer_add_rms_norm(mine, peer, res, w, 1e-5, my_flags, peer_flags)
    ref, ref_summed = peer_add_rms_norm_ref(mine, peer, res, w, 1e-5)
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(summed, ref_summed, **tol)
    torch.testing.assert_close(out, ref, **tol)
    programs = min(rows, flags)  # more rows than flags: the programs loop over the rows
    assert my_flags[:programs].eq(0).all() and my_flags[programs:].eq(1).all()  # signals consumed
    assert peer_flags[:programs].eq(1).all() and peer_flags[programs:].eq(0).all()  # one sent each


def test_peer_add_rms_norm_sum_is_the_same_on_both_ranks() -> None:
    """Each rank adds the other's product to its own: the replicated residual stream must come out
    bit for bit the same on both, or the ranks drift apart."""
    gen = torch.Generator().manual_seed(3)
    a, b, res = (torch.randn(5, 64, generator=gen).to(DEVICE) for _ in range(3))
    w = torch.ones(64, device=DEVICE)

    def flags() -> tuple[torch.Tensor, torch.Tensor]:
        zeros = torch.zeros(8, dtype=torch.int32, device=DEVICE)
        return zeros + 1, zeros

    out0, sum0 = peer_add_rms_norm(a, b, res, w, 1e-6, *flags())
    out1, sum1 = peer_add_rms_norm(b, a, res, w, 1e-6, *flags())
    assert torch.equal(sum0, sum1) and torch.equal(out0, out1)


def test_peer_add_rms_norm_refuses_mismatched_operands() -> None:
    x = torch.zeros(2, 8, device=DEVICE)
    f = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="peer"):
        peer_add_rms_norm(x, torch.zeros(3, 8, device=DEVICE), x, x[0], 1e-6, f, f)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "hidden", "flags"), [(1, 64, 8), (13, 40, 4)])
def test_pushed_products_are_written_to_the_peer_and_read_from_here(
    dtype: torch.dtype, rows: int, hidden: int, flags: int
) -> None:
    """Push: this rank's product lands in the peer's incoming buffer whole, and the sum takes the
    peer's product from this rank's own incoming buffer (as the peer's programs wrote it)."""
    gen = torch.Generator().manual_seed(rows + hidden)
    mine, incoming, res = (torch.randn(rows, hidden, generator=gen).to(DEVICE, dtype) for _ in range(3))
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(DEVICE, dtype)
    peer_incoming = torch.full_like(mine, float("nan"))
    my_flags = torch.ones(flags, dtype=torch.int32, device=DEVICE)
    peer_flags = torch.zeros(flags, dtype=torch.int32, device=DEVICE)
    out, summed = peer_add_rms_norm(mine, incoming, res, w, 1e-5, my_flags, peer_flags, push=peer_incoming)
    ref, ref_summed = peer_add_rms_norm_ref(mine, incoming, res, w, 1e-5)
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(summed, ref_summed, **tol)
    torch.testing.assert_close(out, ref, **tol)
    assert torch.equal(peer_incoming, mine)  # every row pushed, by whichever program holds it
    programs = min(rows, flags)
    assert my_flags[:programs].eq(0).all() and peer_flags[:programs].eq(1).all()


@pytest.mark.parametrize("push", [False, True])
@pytest.mark.parametrize(("rows", "flags"), [(1, 8), (13, 4)])
def test_call_count_signal_counts_each_program_once(push: bool, rows: int, flags: int) -> None:
    """Signal by call count: each program adds one to its own count, writes it to the peer's flag and
    goes on once its own flag has reached it (the peer's program of the same call, or a later one)."""
    gen = torch.Generator().manual_seed(rows + 17)
    mine, incoming, res = (torch.randn(rows, 64, generator=gen).to(DEVICE) for _ in range(3))
    w = torch.ones(64, device=DEVICE)
    programs = min(rows, flags)
    calls = torch.full((flags,), 41, dtype=torch.int64, device=DEVICE)
    my_flags = torch.full((flags,), 42, dtype=torch.int64, device=DEVICE)  # the peer's 42nd call signalled
    peer_flags = torch.full((flags,), 41, dtype=torch.int64, device=DEVICE)
    pushed = torch.zeros_like(mine) if push else None
    out, summed = peer_add_rms_norm(mine, incoming, res, w, 1e-5, my_flags, peer_flags, pushed, calls=calls)
    ref, ref_summed = peer_add_rms_norm_ref(mine, incoming, res, w, 1e-5)
    torch.testing.assert_close(summed, ref_summed, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert calls[:programs].eq(42).all() and calls[programs:].eq(41).all()
    assert peer_flags[:programs].eq(42).all() and peer_flags[programs:].eq(41).all()
    assert my_flags.eq(42).all()  # read, never consumed: the count only grows
    if push:
        assert torch.equal(pushed, mine)


def test_call_count_signal_wants_int64_flags() -> None:
    x = torch.zeros(2, 8, device=DEVICE)
    f32 = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="int64"):
        peer_add_rms_norm(
            x, x, x, x[0], 1e-6, f32, f32, calls=torch.zeros(4, dtype=torch.int64, device=DEVICE)
        )


class _Slots:
    """One rank's view of ``_FusedSlots`` on one device: the peer has already made its call."""

    size = 2

    def __init__(self, rows: int, cols: int) -> None:
        gen = torch.Generator().manual_seed(rows)
        self.mine, self.peer_product, self.incoming = (
            torch.randn(rows, cols, generator=gen).to(DEVICE) for _ in range(3)
        )
        self.peer_incoming = torch.full_like(self.mine, float("nan"))
        self.flags = torch.ones(8, dtype=torch.int32, device=DEVICE)
        self.peer_flags = torch.zeros(8, dtype=torch.int32, device=DEVICE)
        self.counts = torch.ones(8, dtype=torch.int64, device=DEVICE)
        self.peer_counts = torch.zeros(8, dtype=torch.int64, device=DEVICE)
        self.calls = torch.zeros(8, dtype=torch.int64, device=DEVICE)
        self.abort = torch.zeros(1, dtype=torch.int32, device=DEVICE)

    def views(self, *shape: object) -> tuple[torch.Tensor, torch.Tensor]:  # (slot, rows, cols, dtype)
        return self.mine, self.peer_product

    def pushed(self, *shape: object) -> tuple[torch.Tensor, torch.Tensor]:
        return self.incoming, self.peer_incoming


@pytest.mark.parametrize("signal", ["count", "swap"])
def test_peer_sum_meets_as_the_switch_says(monkeypatch: pytest.MonkeyPatch, signal: str) -> None:
    """The engine's call site: by count it reads the peer's product at every size and raises the
    counts; by swap it pushes decode-sized products (<= 64 rows) and consumes the swap flags."""
    from prefixserve.model.peer_allreduce import PeerSum

    monkeypatch.setenv("PREFIXSERVE_PEER_SIGNAL", signal)
    monkeypatch.delenv("PREFIXSERVE_PEER_PUSH", raising=False)
    slots = _Slots(rows=3, cols=32)
    res, w = torch.randn(3, 32).to(DEVICE), torch.ones(32, device=DEVICE)
    out, summed = PeerSum(slots, 0, slots.mine).add_rms_norm(res, w, 1e-5)  # type: ignore[arg-type]
    peer = slots.peer_product if signal == "count" else slots.incoming
    ref, ref_summed = peer_add_rms_norm_ref(slots.mine, peer, res, w, 1e-5)
    torch.testing.assert_close(summed, ref_summed, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    if signal == "count":
        assert slots.calls[:3].eq(1).all() and slots.peer_counts[:3].eq(1).all()
        assert slots.peer_incoming.isnan().all() and slots.peer_flags.eq(0).all()  # nothing pushed
    else:
        assert torch.equal(slots.peer_incoming, slots.mine) and slots.peer_flags[:3].eq(1).all()
        assert slots.calls.eq(0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("signal", ["swap", "count"])
def test_peer_sum_without_a_residual_is_the_first_norm(dtype: torch.dtype, signal: str) -> None:
    """The embedding's lookups (no residual stream yet): the stream out is the ranks' sum, a new
    tensor, and the norm is of that sum; the residual operand is never read."""
    gen = torch.Generator().manual_seed(11)
    mine, peer = (torch.randn(6, 96, generator=gen).to(DEVICE, dtype) for _ in range(2))
    w = (1 + 0.1 * torch.randn(96, generator=gen)).to(DEVICE, dtype)
    if signal == "count":
        my_flags = torch.ones(8, dtype=torch.int64, device=DEVICE)
        peer_flags, calls = torch.zeros_like(my_flags), torch.zeros_like(my_flags)
    else:
        my_flags = torch.ones(8, dtype=torch.int32, device=DEVICE)
        peer_flags, calls = torch.zeros_like(my_flags), None
    out, summed = peer_add_rms_norm(mine, peer, None, w, 1e-5, my_flags, peer_flags, calls=calls)
    ref, ref_summed = peer_add_rms_norm_ref(mine, peer, None, w, 1e-5)
    assert torch.equal(summed, ref_summed)  # one rounding of an exact fp32 sum: bit for bit
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(out, ref, **tol)
    assert summed.data_ptr() not in (mine.data_ptr(), peer.data_ptr())


@pytest.mark.parametrize("count", [False, True])
def test_a_raised_abort_ends_the_wait_for_a_peer_that_never_signals(count: bool) -> None:
    """A dead peer never signals: with the abort flag raised (``PeerAbort``) the call returns at once,
    under both meeting protocols, rather than spin for the life of the process."""
    x = torch.ones(3, 64, device=DEVICE)
    if count:  # the peer's count stays behind this call's
        flags = torch.zeros(4, dtype=torch.int64, device=DEVICE)
        extra = {"calls": torch.full((4,), 7, dtype=torch.int64, device=DEVICE)}
        peer_flags = flags.clone()
    else:  # the peer never consumed the last signal nor sent one
        flags, peer_flags, extra = (
            torch.zeros(4, dtype=torch.int32, device=DEVICE),
            torch.ones(4, dtype=torch.int32, device=DEVICE),
            {},
        )
    abort = torch.ones(1, dtype=torch.int32, device=DEVICE)
    out, summed = peer_add_rms_norm(x, x, x, x[0], 1e-6, flags, peer_flags, abort=abort, **extra)
    assert out.shape == summed.shape == x.shape
    if count:
        assert extra["calls"][:3].eq(8).all()  # the call was counted; only the wait gave up
