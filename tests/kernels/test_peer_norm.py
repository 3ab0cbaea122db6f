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


def _counters() -> tuple[torch.Tensor, ...]:
    """(tickets, expected, calls), one 16-byte aligned int64 count each."""
    return tuple(torch.zeros(2, dtype=torch.int64, device=DEVICE)[:1] for _ in range(3))


@pytest.mark.parametrize("rows", [1, 5, 16, 40])
def test_a_pushing_producer_writes_both_places_and_signals_once_per_call(rows: int) -> None:
    """The skinny kernel with a push target: the product here and in the peer's buffer, the last of
    its programs bumping the counts once per call (tickets back to 0, expected and the peer's calls
    up by one); a norm waiting on those counts then sums the pushed product."""
    from prefixserve.model.kernels import skinny_matmul
    from prefixserve.model.kernels.push_signal import PushTarget

    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float16
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 256, generator=gen).to(DEVICE, dtype)
    w = torch.randn(512, 256, generator=gen).to(DEVICE, dtype) / 16
    out, peer_out = (torch.zeros(rows, 512, device=DEVICE, dtype=dtype) for _ in range(2))
    tickets, expected, calls = _counters()
    target = PushTarget(peer_out, tickets, expected, calls)
    for call in (1, 2):
        assert skinny_matmul.linear_if_faster(x, w, out=out, push=target) is out
        assert torch.equal(out, peer_out)
        assert (int(tickets), int(expected), int(calls)) == (0, call, call)
    torch.testing.assert_close(out.float(), (x.float() @ w.float().t()), atol=3e-2, rtol=3e-2)
    # this rank's norm: the peer's product arrived (its calls reached our expected count)
    res = torch.randn(rows, 512, generator=gen).to(DEVICE, dtype)
    norm_w = torch.ones(512, device=DEVICE, dtype=dtype)
    flags = torch.zeros(8, dtype=torch.int32, device=DEVICE)  # untouched in this mode
    got, summed = peer_add_rms_norm(out, peer_out, res, norm_w, 1e-5, flags, flags, arrived=(calls, expected))
    ref, ref_summed = peer_add_rms_norm_ref(out, peer_out, res, norm_w, 1e-5)
    torch.testing.assert_close(summed, ref_summed, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)
    assert flags.eq(0).all()


@pytest.mark.parametrize(("rows", "cols", "k"), [(65, 256, 128), (130, 128, 192), (200, 384, 64)])
def test_push_matmul_writes_both_places_and_signals_once_per_call(rows: int, cols: int, k: int) -> None:
    """The 65-512-row product with a push target, against the torch reference: the tiles here and in
    the peer's buffer, one signal per call whatever the number of programs."""
    from prefixserve.model.kernels import push_matmul
    from prefixserve.model.kernels.push_signal import PushTarget

    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float16
    gen = torch.Generator().manual_seed(rows + cols)
    x = torch.randn(rows, k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(cols, k, generator=gen) / 8).to(DEVICE, dtype)
    out, peer_out = (torch.zeros(rows, cols, device=DEVICE, dtype=dtype) for _ in range(2))
    tickets, expected, calls = _counters()
    target = PushTarget(peer_out, tickets, expected, calls)
    for call in (1, 2, 3):
        assert push_matmul.push_linear(x, w, out, target, config=(64, 64, 2, 4)) is out
        assert torch.equal(out, peer_out)
        assert (int(tickets), int(expected), int(calls)) == (0, call, call)
    torch.testing.assert_close(out.float(), x.float() @ w.float().t(), atol=3e-2, rtol=3e-2)
    with pytest.raises(ValueError, match="push_linear"):
        push_matmul.push_linear(x[:64], w, out[:64], target)
